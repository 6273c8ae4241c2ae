"""The decode graph runner's verify staging (Q token rows per sequence), on the CPU: the
graph body is replaced by a recorder, so only what the graph would read is checked: token
rows, positions, slots across block boundaries, lengths, block tables and the padding
sequences' null-block layout, between verify and decode calls.

Owner: tests. (Moved here from tests/gpu/test_decode_runner.py, where only CUDA or the
interpreter ran them.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale import LLM
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from tests.helpers.checkpoints import DENSE_VARIANTS, build

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
BS = 16


def _tables(rows: int, blocks: int, seed: int) -> np.ndarray:
    """Distinct shuffled blocks (none is the null block 0) for each row."""
    perm = np.random.default_rng(seed).permutation(np.arange(1, 1 + rows * blocks))
    return perm.reshape(rows, blocks).astype(np.int64)


def _staging_runner(query_lens: tuple[int, ...]) -> tuple[DecodeGraphRunner, list[tuple]]:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    model = llm.engine.model
    runner = DecodeGraphRunner(
        model.module, model.kv_cache.layers, model.device, 8, 32, BS, query_lens=query_lens
    )
    vocab = model.config.vocab_size
    calls: list[tuple] = []

    def body(rows: int, query_len: int = 1) -> torch.Tensor:
        # Only the staging is under test: record what the graph would see.
        calls.append((rows, query_len, runner._meta(rows, query_len)))
        return torch.arange(rows * query_len, dtype=torch.float32)[:, None].expand(-1, vocab)

    runner._body = body  # type: ignore[method-assign]
    return runner, calls


def _check_verify_buffers(
    runner: DecodeGraphRunner, tokens: np.ndarray, starts: np.ndarray, tables: np.ndarray
) -> None:
    rows, ql = tokens.shape
    rung = next(r for r in runner.rungs if r >= rows)
    real, total = rows * ql, rung * ql
    positions = [int(s) + j for s in starts for j in range(ql)]
    slots = [int(tables[b, p // BS]) * BS + p % BS for b in range(rows)
             for p in range(int(starts[b]), int(starts[b]) + ql)]  # fmt: skip
    assert runner.input_ids[:real].tolist() == tokens.reshape(-1).tolist()
    assert runner.positions[:real].tolist() == positions
    assert runner.slot_mapping[:real].tolist() == slots
    assert runner.seq_lens[:rows].tolist() == (starts + ql).tolist()
    width = tables.shape[1]
    assert torch.equal(runner.block_tables[:rows, :width], torch.from_numpy(tables).int())
    # Padding sequences: tokens 0 at positions 0..Q-1 on slots 0..Q-1 of the null block.
    pad = [j for _ in range(rung - rows) for j in range(ql)]
    assert runner.input_ids[real:total].tolist() == [0] * len(pad)
    assert runner.positions[real:total].tolist() == pad
    assert runner.slot_mapping[real:total].tolist() == pad
    assert runner.seq_lens[rows:rung].tolist() == [ql] * (rung - rows)
    assert runner.block_tables[rows:rung, 0].tolist() == [0] * (rung - rows)


def test_verify_staging_mixed_lengths_and_padding() -> None:
    """`run_verify` stages token rows, positions, slots (crossing block boundaries), lengths
    and tables for mixed context lengths with padding sequences; decode calls in between
    (Q = 1, same tables: not re-sent) keep their own layout; the metadata the body gets
    says Q rows per decode sequence."""
    runner, calls = _staging_runner((1, 3))
    assert runner.input_ids.shape[0] == runner.max_rows * 3
    tables = _tables(5, 4, 0)
    tokens = np.arange(100, 115, dtype=np.int64).reshape(5, 3)
    starts = np.array([0, 14, 30, 7, 45], dtype=np.int64)  # 14+2, 30+2 cross a block
    out = runner.run_verify(tokens, starts, tables)  # rung 8: three padding sequences
    assert out.shape[0] == 15
    assert out[:, 0].tolist() == list(range(15)), "rows come back in token-row order"
    _check_verify_buffers(runner, tokens, starts, tables)
    rows, ql, meta = calls[-1]
    assert (rows, ql) == (8, 3) and meta.decode_query_len == 3 and meta.num_decode == 8
    assert meta.query_start_loc.tolist() == [3 * b for b in range(9)]
    assert meta.positions.shape[0] == 24 and meta.max_query_len == 3

    # A decode step on the same tables (not re-sent), then verify again on fewer rows.
    positions = starts + 3
    runner.run(tokens[:, 0].copy(), positions, tables)
    assert calls[-1][:2] == (8, 1) and calls[-1][2].decode_query_len == 1
    assert runner.positions[:5].tolist() == positions.tolist()
    assert runner.seq_lens[:8].tolist() == [*(positions + 1).tolist(), 1, 1, 1]
    assert runner.slot_mapping[5:8].tolist() == [0, 0, 0]
    few = tables[:3]
    runner.run_verify(tokens[:3] + 1, starts[:3] + 1, few)  # rung 4: one padding sequence
    _check_verify_buffers(runner, tokens[:3] + 1, starts[:3] + 1, few)
    runner.run_verify(tokens[:1], starts[:1], tables[:1])  # rung 1: no padding
    _check_verify_buffers(runner, tokens[:1], starts[:1], tables[:1])

    with pytest.raises(ValueError, match="Q=4"):
        runner.run_verify(np.zeros((2, 4), dtype=np.int64), starts[:2], tables[:2])
    assert runner.can_run(8, 3) and not runner.can_run(8, 4) and not runner.can_run(9, 3)


def test_verify_padding_covers_query_lens_past_a_block() -> None:
    """Q longer than a block: padding sequences read null-block columns 0 and 1, which a
    table skipped as unchanged since a Q = 1 step must still have zeroed."""
    runner, _ = _staging_runner((1, BS + 2))
    tables = _tables(3, 4, 1)
    runner.block_tables.fill_(7)  # stale entries everywhere
    runner.run(np.array([1, 2, 3]), np.array([5, 6, 7]), tables)
    assert runner.block_tables[3, :2].tolist() == [0, 7]
    ql = BS + 2
    tokens = np.ones((3, ql), dtype=np.int64)
    runner.run_verify(tokens, np.array([5, 6, 7]), tables)
    assert runner.block_tables[3, :2].tolist() == [0, 0]
    assert runner.slot_mapping[3 * ql : 4 * ql].tolist() == [j % BS for j in range(ql)]
