"""The decode graph runner's input staging on the CPU (no graphs captured): after every call the persistent buffers hold exactly that call's rows,
padding rows point at the null block, a fed call gathers its ids from the previous tokens, and
skipping an unchanged block table never leaves another rung's table in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale import LLM
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from tests.helpers.checkpoints import DENSE_VARIANTS, build

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")


def _runner() -> DecodeGraphRunner:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    model = llm.engine.model
    runner = DecodeGraphRunner(model.module, model.kv_cache.layers, model.device, 8, 32, 16)
    # Only the staging is under test: the graph body (whose attention must not read host
    # lengths, which the CPU reference does) is replaced by logits of the right shape.
    vocab = model.config.vocab_size
    runner._body = lambda rows: torch.zeros(rows, vocab)  # type: ignore[method-assign]
    return runner


def _check(
    runner: DecodeGraphRunner,
    ids: list[int],
    positions: list[int],
    tables: np.ndarray,
    pad_token: int = 0,
) -> None:
    rows = len(ids)
    rung = next(r for r in runner.rungs if r >= rows)
    width = tables.shape[1]
    assert runner.input_ids[:rows].tolist() == ids
    assert runner.positions[:rows].tolist() == positions
    assert runner.seq_lens[:rows].tolist() == [p + 1 for p in positions]
    slots = [int(tables[i, p // 16]) * 16 + p % 16 for i, p in enumerate(positions)]
    assert runner.slot_mapping[:rows].tolist() == slots
    assert torch.equal(runner.block_tables[:rows, :width], torch.from_numpy(tables).int())
    # Padding rows: at position 0, one token long, writing slot 0 of the null block (their
    # token: 0, or a fed call's row 0 of the previous tokens).
    assert runner.input_ids[rows:rung].tolist() == [pad_token] * (rung - rows)
    assert runner.positions[rows:rung].tolist() == [0] * (rung - rows)
    assert runner.seq_lens[rows:rung].tolist() == [1] * (rung - rows)
    assert runner.slot_mapping[rows:rung].tolist() == [0] * (rung - rows)
    assert runner.block_tables[rows:rung, 0].tolist() == [0] * (rung - rows)


def test_buffers_hold_each_calls_rows_across_rungs_and_skipped_tables() -> None:
    runner = _runner()
    wide = np.array([[3, 4], [5, 6], [7, 8], [9, 10], [11, 12]], dtype=np.int64)
    narrow = np.array([[20, 21], [22, 23], [24, 25]], dtype=np.int64)
    calls = [
        (wide, [5, 6, 7, 8, 9], [17, 18, 19, 20, 21]),  # rung 8, table sent
        (wide, [1, 2, 3, 4, 5], [18, 19, 20, 21, 22]),  # same rung and table: not re-sent
        (narrow, [9, 9, 9], [16, 17, 30]),  # rung 4 overwrites rows 0-2 and pads row 3
        (wide, [5, 6, 7, 8, 9], [19, 20, 21, 22, 23]),  # back to rung 8: must be re-sent
        (wide[:1], [4], [31]),  # rung 1
    ]
    for tables, ids, positions in calls:
        out = runner.run(np.array(ids), np.array(positions), tables)
        assert out.shape[0] == len(ids)
        _check(runner, ids, positions, tables)


def test_fed_call_gathers_ids_from_the_previous_tokens() -> None:
    runner = _runner()
    tables = np.array([[3, 4], [5, 6], [7, 8]], dtype=np.int64)
    previous_tokens = torch.tensor([40, 41, 42, 43], dtype=torch.int64)
    source_rows = np.array([2, 0, 3])
    runner.run(source_rows, np.array([17, 18, 19]), tables, previous_tokens)
    _check(runner, [42, 40, 43], [17, 18, 19], tables, pad_token=40)


def test_hybrid_runner_stages_each_rows_ssm_slot_and_pads_with_minus_one() -> None:
    """With SSM layers the per-row pool slot is a graph input: each call's slots land in the
    persistent buffer, the rung's padding rows get -1 (the recurrent kernels skip them), and
    the slots must come with every call and only with SSM layers."""
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    model = llm.engine.model
    ssm = [(torch.zeros(8, 4, 3), torch.zeros(8, 2, 2, 2))]
    runner = DecodeGraphRunner(
        model.module, model.kv_cache.layers, model.device, 8, 32, 16, ssm_layers=ssm
    )
    runner._body = lambda rows: torch.zeros(rows, 8)  # type: ignore[method-assign]
    tables = np.array([[3, 4], [5, 6], [7, 8], [9, 10], [11, 12]], dtype=np.int64)
    for slots in ([6, 1, 0, 3, 2], [5, 7, 4]):  # rung 8, then rung 4 over the same buffer
        rows = len(slots)
        rung = next(r for r in runner.rungs if r >= rows)
        runner.run(np.arange(rows), np.arange(rows) + 17, tables[:rows], ssm_slots=np.array(slots))
        assert runner.ssm_slots[:rung].tolist() == slots + [-1] * (rung - rows)
        assert runner._meta(rung).ssm_slots.tolist() == slots + [-1] * (rung - rows)
        _check(runner, list(range(rows)), list(range(17, 17 + rows)), tables[:rows])
    with pytest.raises(ValueError, match="SSM slots go with the graphs of a hybrid model"):
        runner.run(np.arange(2), np.arange(2) + 17, tables[:2])
    with pytest.raises(ValueError, match="must name one pool slot"):
        runner.run(np.arange(2), np.arange(2), tables[:2], ssm_slots=np.array([1, -1]))
    plain = _runner()
    with pytest.raises(ValueError, match="SSM slots go with the graphs of a hybrid model"):
        plain.run(np.arange(2), np.arange(2) + 17, tables[:2], ssm_slots=np.array([0, 1]))
    with pytest.raises(ValueError, match="verify graphs"):
        DecodeGraphRunner(
            model.module, model.kv_cache.layers, model.device, 8, 32, 16, (1, 3), ssm_layers=ssm
        )


def test_factory_refuses_hybrid_graphs_it_cannot_capture(caplog: pytest.LogCaptureFixture) -> None:
    """Graphs for a hybrid need the Triton recurrent decode ops (padding slot -1) and, with MoE
    layers, a capturable expert op; otherwise start-up says why and decode stays eager."""
    from metrale.model_engine.cuda_graphs import RECURRENT_DECODE_OPS
    from metrale.model_engine.factory import _capture_graphs
    from tests.helpers.checkpoints import HYBRID_VARIANTS

    triton = {"paged_attention": "triton", **dict.fromkeys(RECURRENT_DECODE_OPS, "triton")}
    cases = [
        ("nemotronh-classic", {"paged_attention": "triton"}, "recurrent layers use reference ops"),
        (
            "nemotronh-moe",
            {**triton, "moe_experts": "torch"},
            "MoE experts op is the torch reference",
        ),
    ]
    for name, kernels, reason in cases:
        variant = next(v for v in HYBRID_VARIANTS if v.name == name)
        llm = LLM(str(build(variant)), device="cpu", num_kv_blocks=40, max_num_seqs=2)
        model = llm.engine.model
        caplog.clear()
        with caplog.at_level("WARNING", logger="metrale.model_engine.factory"):
            _capture_graphs(model, llm.config, 64, None, kernels)  # type: ignore[arg-type]
        assert model.graph_runner is None
        assert any(reason in r.getMessage() for r in caplog.records), caplog.text
