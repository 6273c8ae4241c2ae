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
from tests.helpers.checkpoints import DENSE_VARIANTS, HYBRID_VARIANTS, build, copy_checkpoint
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


def test_the_server_card_reports_the_kv_dtype() -> None:
    """What `/v1/models` reads (`EngineInfo`, which crosses to the server process)."""
    from metrale.engine.snapshot import engine_info

    llm = LLM(str(build(VARIANT)), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16)
    info = engine_info(llm.engine)
    assert (info.kv_cache_dtype, info.weight_dtype, info.dtype) == (
        "fp8_e4m3",
        "float32",
        "float32",
    )


def test_bad_kv_cache_dtype_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError, match=r"kv_cache_dtype.*'int4' is not one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(InvalidRequestError, match="batch-invariant"):
        EngineConfig(kv_cache_dtype="fp8", batch_invariant=True)


# -------------------------------------------------------------------------------------------
# The other KV users copy float8 blocks bytewise: with fixed (checkpoint) scales, runs that
# preempt, swap, restore or read host blocks give the tokens of a plain float8 run.
# -------------------------------------------------------------------------------------------

#: Checkpoint scales near the calibrated ones of this model (amax about 3.3 for K, 0.7 for V).
FIXED_SCALES = {
    f"model.layers.{i}.self_attn.{name}": value
    for i in range(2)
    for name, value in (("k_scale", 0.008), ("v_scale", 0.002))
}


@functools.cache
def fixed_scale_checkpoint() -> str:
    import atexit
    import shutil
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="metrale-fp8kv-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return str(_with_scales(out / "ckpt", FIXED_SCALES))


def _workload(count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(6, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 30, (count,), generator=g)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_k=50, max_tokens=40, min_tokens=40, seed=7 + i)
        for i in range(count)
    ]
    return prompts, params


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_fp8_blocks_survive_preemption_and_prefix_reuse(mode: str) -> None:
    prompts, params = _workload(16)
    prompts = prompts + prompts[:4]  # repeats: prefix-cache hits on float8 blocks
    params = params + params[:4]
    ample = make_llm("fp8", fixed_scale_checkpoint(), num_kv_blocks=300, max_num_seqs=16)
    tight = make_llm(
        "fp8", fixed_scale_checkpoint(), num_kv_blocks=14, max_num_seqs=16, preemption_mode=mode
    )
    want = [o.outputs[0].token_ids for o in ample.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert got == want
    stats = tight.engine.scheduler.stats
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    if mode == "swap":
        assert stats.swapped_out_blocks > 0


def test_fp8_blocks_read_from_host_memory_by_high_speed_swap() -> None:
    prompts = [list(range(6, 6 + 120)), list(range(300, 300 + 90))]
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    common = dict(block_size=8, enable_prefix_caching=False)
    resident = make_llm("fp8", fixed_scale_checkpoint(), num_kv_blocks=128, **common)
    swapping = make_llm(
        "fp8", fixed_scale_checkpoint(), num_kv_blocks=24, high_speed_swap=True,
        high_speed_swap_blocks_per_seq=2, max_prefill_chunk=16, **common,
    )  # fmt: skip
    want = [o.outputs[0].token_ids for o in resident.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in swapping.generate(prompts, params)] == want
    hss = swapping.engine.model.hss
    assert hss is not None and hss.stored_blocks > 0


def test_fp8_blocks_restored_from_the_host_tier() -> None:
    prompt = list(range(10, 10 + 40))
    others = [list(range(100 + 30 * i, 100 + 30 * i + 28)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    probe = make_llm("fp8", fixed_scale_checkpoint(), num_kv_blocks=32, block_size=8)
    size = len(probe.engine.model.kv_cache.block_bytes(1))
    llm = make_llm(
        "fp8", fixed_scale_checkpoint(), num_kv_blocks=32, block_size=8,
        kv_offload_host_gb=64 * size / 2**30,
    )  # fmt: skip
    first = llm.generate([prompt], params)[0]
    llm.generate(others, params)  # pushes the prompt's blocks out of the device pool
    again = llm.generate([prompt], params)[0]
    tiers = llm.engine.model.kv_tiers
    assert tiers is not None and tiers.stats.host.hits > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.outputs[0].logprobs == first.outputs[0].logprobs  # the same bytes read back


def test_fp8_with_calibrated_scales_refuses_the_disk_tier(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="disk KV tier"):
        make_llm("fp8", kv_offload_disk=str(tmp_path), kv_offload_disk_gb=0.01)


# -------------------------------------------------------------------------------------------
# The bundled trained model (real margins), its MTP head, and hybrid models
# -------------------------------------------------------------------------------------------

BUNDLED = str(Path(__file__).resolve().parents[2] / "metrale" / "assets" / "tiny-code")
CODE = [
    "def fibonacci(n):\n", "import os\n\n", "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n", "from typing import", "def read(path):\n    with open(path) as f:\n",
]  # fmt: skip


def test_bundled_model_fp8_kv_greedy_agrees_with_float32_kv() -> None:
    """The trained model (real margins) with float8 against float32 KV, teacher-forced: the
    float32 run's greedy sequences scored under both, and the share of positions where the
    float8 run's top-1 token is the float32 run's greedy token must be >= 95% (measured
    188/192 = 98% here; the 4 others are near-ties, margins < 0.07 nat). Teacher forcing
    counts every position on the same context, where free-running runs that part at a
    near-tie (the two here do, at steps 7 and 20) would stop counting."""
    new = 32
    params = SamplingParams(temperature=0, max_tokens=new, min_tokens=new)
    llms = {
        d: LLM(BUNDLED, device="cpu", dtype="float32", num_kv_blocks=200, kv_cache_dtype=d)
        for d in ("auto", "fp8")
    }
    prompts = [llms["auto"].get_tokenizer().encode(t) for t in CODE]
    outs = llms["auto"].generate(prompts, params)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1)
    scored = llms["fp8"].generate(seqs, scoring)
    assert llms["fp8"].engine.model.kv_cache.scales_source == "calibrated"
    agree = total = 0
    for prompt, out in zip(prompts, scored, strict=True):
        ids = out.prompt_token_ids
        for i in range(len(prompt), len(ids)):
            rows = out.prompt_logprobs[i]
            top = max(rows.items(), key=lambda item: item[1].logprob)[0]
            agree += top == ids[i]
            total += 1
    assert total == new * len(CODE)
    assert agree >= 0.95 * total, f"{agree}/{total} greedy tokens agree"


def test_fp8_kv_with_mtp_speculation_keeps_the_plain_tokens() -> None:
    """The MTP head's KV layer lives in the same float8 pool (and calibrates on its first
    write); verified tokens stay those of plain decoding with float8 KV."""
    mtp = {"method": "mtp", "num_speculative_tokens": 2, "gate": "off"}
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
    plain = LLM(BUNDLED, device="cpu", num_kv_blocks=200, kv_cache_dtype="fp8")
    spec = LLM(
        BUNDLED, device="cpu", num_kv_blocks=200, kv_cache_dtype="fp8", speculative_config=mtp
    )
    prompts = [plain.get_tokenizer().encode(t) for t in CODE]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    kv = spec.engine.model.kv_cache
    assert kv.num_layers == 7 and kv.scales_source == "calibrated"  # 6 main + 1 head layer
    assert torch.equal(kv.scales[:6], plain.engine.model.kv_cache.scales)
    assert spec.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["bamba", "nemotronh-classic", "qwen3next"])
def test_hybrid_models_calibrate_their_attention_layers(name: str) -> None:
    variant = next(v for v in HYBRID_VARIANTS if v.name == name)
    prompts = [list(range(10, 40)), list(range(100, 125))]
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)
    llm = make_llm("fp8", str(build(variant)), num_kv_blocks=100)
    scored = llm.generate(prompts, scoring)
    want = make_llm("auto", str(build(variant)), num_kv_blocks=100).generate(prompts, scoring)
    kv = llm.engine.model.kv_cache
    assert kv.scales_source == "calibrated" and bool((kv.scales != 1.0).all())
    for a, b in zip(scored, want, strict=True):
        diff = torch.tensor(_token_logprobs(a)) - torch.tensor(_token_logprobs(b))
        assert 0 < float(diff.abs().max()) <= LOGPROB_ATOL
