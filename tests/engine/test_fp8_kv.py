"""FP8 KV cache on the CPU engine (`kv_cache_dtype="fp8"`): the engine against its own
model-dtype KV run on a tiny random Qwen3 (float32), the per-layer scales (calibrated on the
first prefill, or read from checkpoint tensors), the pool sizing, and the refusals.

Tolerances. E4M3 keeps 3 mantissa bits: a stored K or V element is off by up to 2^-4 of its
magnitude (round to nearest). Through softmax attention and two layers this moves a token's
logprob by about 0.01 nat on this model (measured max 0.014 over the 8 prompts x ~40 scored
tokens); the check allows LOGPROB_ATOL = 0.03 nats per token (about twice that). Greedy
tokens must then agree wherever the model-dtype run's top-1 / top-2 margin is at least twice
that tolerance: a swap there would need a logprob error above the tolerance. The random
model's distributions are nearly flat (logprobs near log(1/512), margins of hundredths), so
many steps are near-ties where the runs may part; the test counts the decisive steps (about
30 here) and requires at least 16 so that it means something.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig
from metrale.errors import CheckpointError, InvalidRequestError
from metrale.model_engine.factory import LoadReport, load_model
from tests.helpers.checkpoints import DENSE_VARIANTS, build, copy_checkpoint
from tests.helpers.parity import mixed_prompts

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
LOGPROB_ATOL = 0.03
STEPS = 24


def make_llm(kv_cache_dtype: str, model: str | None = None, **kwargs: object) -> LLM:
    kwargs.setdefault("num_kv_blocks", 160)
    return LLM(
        model or str(build(VARIANT)), device="cpu", dtype="float32",
        kv_cache_dtype=kv_cache_dtype, **kwargs,
    )  # fmt: skip


@functools.cache
def _runs(kv_cache_dtype: str) -> tuple[list, list]:
    """(greedy outputs with top-2 logprobs, prompt-scoring outputs) of one KV dtype."""
    llm = make_llm(kv_cache_dtype)
    greedy = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS, logprobs=2)
    outs = llm.generate(mixed_prompts(8), greedy)
    # Score the model-dtype run's whole sequences (prompt + its greedy tokens) in one prefill:
    # the same tokens under both KV dtypes.
    auto_outs = outs if kv_cache_dtype == "auto" else _runs("auto")[0]
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(mixed_prompts(8), auto_outs)]
    scored = llm.generate(seqs, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    return outs, scored


def _token_logprobs(out: object) -> list[float]:
    ids = out.prompt_token_ids  # type: ignore[attr-defined]
    rows = out.prompt_logprobs  # type: ignore[attr-defined]
    return [rows[i][ids[i]].logprob for i in range(1, len(ids))]


def test_fp8_kv_logprobs_within_tolerance_of_model_dtype_kv() -> None:
    _, auto = _runs("auto")
    _, fp8 = _runs("fp8")
    worst = 0.0
    for a, b in zip(auto, fp8, strict=True):
        la, lb = torch.tensor(_token_logprobs(a)), torch.tensor(_token_logprobs(b))
        worst = max(worst, float((la - lb).abs().max()))
    assert worst <= LOGPROB_ATOL, f"largest logprob difference {worst:.4f} nats"
    assert worst > 0.0, "the fp8 run matched bit for bit: the KV was not quantized"


def test_fp8_kv_greedy_tokens_agree_where_decisive() -> None:
    auto, _ = _runs("auto")
    fp8, _ = _runs("fp8")
    decisive = 0
    for a, b in zip(auto, fp8, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        for step, (x, y) in enumerate(zip(ta, tb, strict=True)):
            top = sorted((lp.logprob for lp in a.outputs[0].logprobs[step].values()), reverse=True)
            margin = top[0] - top[1]
            if x != y:
                assert margin < 2 * LOGPROB_ATOL, (
                    f"tokens differ at step {step} although the auto run's margin is {margin:.3f}"
                )
                break  # the sequences diverged: later steps see different contexts
            decisive += margin >= 2 * LOGPROB_ATOL
    assert decisive >= 16, f"only {decisive} decisive steps agreed; the prompt set says little"


def test_scales_are_calibrated_on_the_first_prefill() -> None:
    llm = make_llm("fp8")
    kv = llm.engine.model.kv_cache
    assert kv.dtype == torch.float8_e4m3fn and kv.scales_source == "calibrating"
    assert bool((kv.scales == 1.0).all())
    prompt = mixed_prompts(1)[0]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert not kv.calibration_pending and kv.scales_source == "calibrated"
    first = kv.scales.clone()
    assert bool((first != 1.0).all()) and bool((first > 0).all())
    # Fixed from then on: a later prompt with other tokens does not move them.
    llm.generate([mixed_prompts(3, seed=7)[2]], SamplingParams(temperature=0, max_tokens=2))
    assert torch.equal(kv.scales, first)
    # amax / 448 of the first prefill's rows: no stored element saturates on that prompt.
    stored = torch.stack([t[1:].float().abs().amax() for layer in kv.layers for t in layer])
    assert float(stored.max()) <= 448.0


def _with_scales(dst: Path, scales: dict[str, float]) -> Path:
    path = copy_checkpoint(VARIANT, dst)
    tensors = load_file(path / "model.safetensors")
    tensors.update({k: torch.tensor(v, dtype=torch.float32) for k, v in scales.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_scales_are_read_from_checkpoint_tensors(tmp_path: Path) -> None:
    names = {
        "model.layers.0.self_attn.k_scale": 0.02,
        "model.layers.0.self_attn.v_scale": 0.005,
        "model.layers.1.self_attn.kv_scale": 0.03,  # one scale for K and V (older layout)
    }
    path = _with_scales(tmp_path / "ckpt", names)
    llm = make_llm("fp8_e4m3", str(path))
    kv = llm.engine.model.kv_cache
    assert kv.scales_source == "checkpoint" and not kv.calibration_pending
    want = torch.tensor([[0.02, 0.005], [0.03, 0.03]])
    assert torch.allclose(kv.scales.cpu(), want)
    llm.generate([mixed_prompts(1)[0]], SamplingParams(temperature=0, max_tokens=2))
    assert torch.allclose(kv.scales.cpu(), want)  # not recalibrated
    report = llm.engine.load_report
    assert report is not None and report.kv_scales == "checkpoint"


def test_partial_checkpoint_scales_are_an_error(tmp_path: Path) -> None:
    path = _with_scales(tmp_path / "ckpt", {"model.layers.0.self_attn.k_scale": 0.02})
    with pytest.raises(CheckpointError, match="k_scale and v_scale"):
        load_model(EngineConfig(model=str(path), device="cpu", kv_cache_dtype="fp8"), str(path))


def _report(kv_cache_dtype: str) -> LoadReport:
    cfg = EngineConfig(
        model=str(build(VARIANT)), device="cpu", kv_cache_dtype=kv_cache_dtype,
        cpu_kv_cache_gb=2**-9,  # 2 MiB: below the cap of max_num_seqs full sequences
    )  # fmt: skip
    return load_model(cfg, str(build(VARIANT)))[1]


def test_fp8_pool_holds_four_times_the_float32_blocks() -> None:
    auto, fp8 = _report("auto"), _report("fp8")
    assert (auto.kv_cache_dtype, fp8.kv_cache_dtype) == ("float32", "fp8_e4m3")
    # float32 -> 1-byte float8: 4x the blocks per GiB (bfloat16 -> float8 doubles them).
    assert fp8.kv_blocks_per_gib == 4 * auto.kv_blocks_per_gib
    assert fp8.num_kv_blocks == 4 * auto.num_kv_blocks
    assert fp8.kv_bytes == auto.kv_bytes


def test_bad_kv_cache_dtype_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match=r"kv_cache_dtype.*'int4' is not one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(InvalidRequestError, match="batch-invariant"):
        EngineConfig(kv_cache_dtype="fp8", batch_invariant=True)
