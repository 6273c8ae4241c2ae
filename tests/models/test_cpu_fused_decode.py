"""The CPU's fused decode step (`kernels/cpu_decode.py`: every layer in one C call) gives the
layer-by-layer path's tokens, with logprobs within float32 summation-order noise, on every
dense variant it takes (plain, GQA, Llama-3 rotary, q/k/v bias with tied embeddings, Qwen3's
q/k norm, YaRN), while requests arrive mid-run so prefill and mixed steps (layer by layer)
interleave with fused decode steps; it declines the models it does not compute (a sliding
window), and `METRALE_CPU_DECODE=layers` turns it off. Parity with transformers itself is
`test_dense_parity.py`'s, which runs through the engine with the fused step on (the default)."""

from __future__ import annotations

from typing import Any

import pytest

from metrale import Engine, EngineConfig, SamplingParams
from metrale.kernels import cpu_decode
from metrale.model_engine.transformer_model import TransformerModel
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.fused_decode import agreement, greedy_run, keep_finished

TAKEN = ["qwen3-qknorm", "qwen2-bias-tied", "llama-gqa4-llama3", "qwen3-classic-yarn-gqa4"]


def _run(variant_name: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Engine]:
    monkeypatch.setenv("METRALE_CPU_DECODE", mode)
    variant = next(v for v in DENSE_VARIANTS if v.name == variant_name)
    engine = Engine(
        EngineConfig(model=str(build(variant)), device="cpu", dtype="float32", num_kv_blocks=200)
    )
    prompts = [[5, 9, 13, 2, 7], list(range(3, 40)), [21, 22]]
    late = [30, 31, 32, 33, 34, 35]
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
    got: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == 4:
            engine.add_request("late", late, params)
        keep_finished(engine.step(), got)
    return got, engine


@pytest.mark.parametrize("name", TAKEN)
def test_fused_step_equals_the_layer_path(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layers, reference = _run(name, "layers", monkeypatch)
    fused, engine = _run(name, "fused", monkeypatch)
    assert reference.model.cpu_decode is None
    assert engine.model.forward_counters()["cpu_fused_decode_forwards"] > 10
    assert fused.keys() == layers.keys() == {"r0", "r1", "r2", "late"}
    for rid, (tokens, lps) in layers.items():
        assert fused[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(fused[rid][1], lps)) < 1e-5, rid


def test_rows_straight_from_the_host_lists_equal_the_metadata_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`decode_rows` (the fused step from the rows' host lists, what `TransformerModel` runs
    for the forwards it takes whole) gives exactly what the step called with the forward's
    `AttentionMetadata` gives: the same tokens and logprobs, bit for bit."""
    calls = []
    decode_rows = cpu_decode.CpuDecodeStack.decode_rows

    def counted(self: cpu_decode.CpuDecodeStack, *args: Any) -> Any:
        calls.append(1)
        return decode_rows(self, *args)

    monkeypatch.setattr(cpu_decode.CpuDecodeStack, "decode_rows", counted)
    direct, engine = _run("qwen3-qknorm", "fused", monkeypatch)
    taken = engine.model.forward_counters()["cpu_fused_decode_forwards"]
    assert len(calls) == taken
    monkeypatch.setattr(TransformerModel, "_fused_decode_rows", lambda *args: None)
    through_meta, engine = _run("qwen3-qknorm", "fused", monkeypatch)
    assert engine.model.forward_counters()["cpu_fused_decode_forwards"] == taken > 10
    assert direct == through_meta


def test_declines_what_it_does_not_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    _, engine = _run("mistral-window", "fused", monkeypatch)
    assert engine.model.cpu_decode is None
    assert "cpu_fused_decode_forwards" not in engine.model.forward_counters()


def test_unknown_mode_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_CPU_DECODE", "fast")
    with pytest.raises(ValueError, match="METRALE_CPU_DECODE"):
        cpu_decode.mode()


def test_bf16_weights_are_opt_in_and_close() -> None:
    """`METRALE_CPU_WEIGHTS=bf16` (not exact): the fused step's projections read bfloat16
    copies. On this checkpoint (`tools/host_costs_cpu.py`: all 4 x 32 greedy tokens equal to
    float32's, logprobs within 9e-4) most tokens agree and the logprobs stay close. Four
    requests: the fused step takes at most `cpu_decode.MAX_ROWS` rows."""
    name = "qwen3-qknorm"
    variant = next(v for v in DENSE_VARIANTS if v.name == name)
    results = {}
    for weights in ("float32", "bf16"):
        engine, results[weights] = greedy_run(variant, weights)
        assert engine.model.cpu_decode is not None
        assert engine.model.cpu_decode.weights_bf16 == (weights == "bf16")
    agree = total = 0
    for rid, same, tokens, diffs in agreement(results["float32"], results["bf16"]):
        agree, total = agree + same, total + tokens
        assert all(d < 5e-3 for d in diffs), rid
    assert agree >= 0.9 * total
    assert results["float32"] != results["bf16"], "bf16 changed nothing: not in use?"


def test_unknown_weights_mode_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METRALE_CPU_WEIGHTS", "int4")
    with pytest.raises(ValueError, match="METRALE_CPU_WEIGHTS"):
        cpu_decode.weights_mode()


def test_more_rows_than_the_fused_step_takes_run_layer_by_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decode steps of more than `MAX_ROWS` rows keep the layer path (oneDNN's GEMM is faster
    there); fewer take the fused step."""
    monkeypatch.setenv("METRALE_CPU_DECODE", "fused")
    variant = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
    engine = Engine(
        EngineConfig(model=str(build(variant)), device="cpu", dtype="float32", num_kv_blocks=200)
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for i in range(cpu_decode.MAX_ROWS + 2):  # equal lengths: every decode step has them all
        engine.add_request(f"r{i}", [3 + i, 9, 13, 2], params)
    while engine.has_unfinished():
        engine.step()
    assert engine.model.forward_counters()["cpu_fused_decode_forwards"] == 0
    engine.add_request("alone", [5, 6, 7], params)
    while engine.has_unfinished():
        engine.step()
    assert engine.model.forward_counters()["cpu_fused_decode_forwards"] > 0
