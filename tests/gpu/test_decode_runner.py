"""The decode graph runner's persistent buffers and padding against the plain forward: every
Triton kernel on the decode path plus the runner give the reference path's greedy tokens, and
a verify replay (Q token rows per sequence) gives the prefill path's logits.

On CUDA the runner captures real graphs (float32, so both sides round alike). Under
`METRALE_TRITON_INTERPRET=1` the same body runs uncaptured on the CPU through the interpreted
kernels, which checks the buffer, padding and null-block logic without a GPU. The verify
staging tests replace the graph body, so they need no triton, but as tests of this folder
they run with the rest of it (CUDA or the interpreter flag)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.kernels.metadata import AttentionMetadata
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.parity import mixed_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
BS = 16


def _route_through_triton(model) -> None:  # type: ignore[no-untyped-def]
    """On the CPU, route every op through the interpreted Triton kernels."""
    from metrale.kernels.triton_ops import triton_kernel_ops

    ops = triton_kernel_ops()
    for module in model.module.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def test_runner_tokens_equal_the_reference_path() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    llm = LLM(str(build(VARIANT)), device=device, dtype="float32", num_kv_blocks=300,
              max_num_seqs=8, enforce_eager=True)  # fmt: skip
    model = llm.engine.model
    if device == "cpu":
        _route_through_triton(model)
    runner = DecodeGraphRunner(model.module, model.kv_cache.layers, model.device, 8, 32, BS)
    if device == "cuda":
        runner.capture()
    model.graph_runner = runner
    eager_before = model.eager_forwards  # start-up shape warm-up forwards (CUDA) count too
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for batch in (mixed_prompts(5)[:1], mixed_prompts(5)):  # rungs 1 and 8 (5 padded)
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        want = [o.outputs[0].token_ids for o in ref.generate(batch, params)]
        assert got == want
    assert model.eager_forwards - eager_before == 2, "only the two prefills should run eagerly"
    assert llm.engine.fed_steps > 0, "no replay read its input tokens on the device"


# -------------------------------------------------------------------------------------------
# Verify steps: Q token rows per sequence
# -------------------------------------------------------------------------------------------


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


def _prefill_meta(
    query_lens: list[int], starts: list[int], tables: np.ndarray, device: torch.device
) -> AttentionMetadata:
    """Every sequence as a prefill chunk (num_decode = 0): the generic causal path."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    positions = np.concatenate([np.arange(s, s + q) for q, s in zip(query_lens, starts)])
    row = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = tables[row, positions // BS] * BS + positions % BS
    seq_lens = [s + q for q, s in zip(query_lens, starts)]

    def up(a: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=dtype).to(device)

    return AttentionMetadata(
        positions=up(positions, torch.int64),
        slot_mapping=up(slots, torch.int64),
        query_start_loc=up(qsl, torch.int32),
        seq_lens=up(seq_lens, torch.int32),
        block_tables=up(tables, torch.int32),
        num_decode=0,
        query_lens_host=list(query_lens),
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=qsl.tolist(),
    )


def test_verify_logits_equal_the_prefill_path() -> None:
    """A verify replay (Q = 3, three sequences of different lengths, one padding sequence)
    gives the logits of an eager forward of the same rows as prefill chunks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(build(VARIANT)), device=device, dtype="float32", num_kv_blocks=300,
              max_num_seqs=8, enforce_eager=True)  # fmt: skip
    model = llm.engine.model
    if device == "cpu":
        _route_through_triton(model)
    ql = 3
    runner = DecodeGraphRunner(
        model.module, model.kv_cache.layers, model.device, 8, 32, BS, query_lens=(1, ql)
    )
    if device == "cuda":
        runner.capture()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(5)
    starts = [5, 14, 30]  # 14..16 and 30..32 cross a block boundary
    tables = _tables(3, 3, 2)
    kv = model.kv_cache.layers

    def eager(tokens: np.ndarray, query_lens: list[int], at: list[int]) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64).to(model.device)
        meta = _prefill_meta(query_lens, at, tables, model.device)
        with torch.inference_mode():
            return model.module.compute_logits(model.module(ids, meta.positions, meta, kv))

    eager(rng.integers(3, vocab, sum(starts)), starts, [0, 0, 0])  # the cached prefixes
    drafts = rng.integers(3, vocab, (3, ql))
    got = runner.run_verify(drafts, np.array(starts), tables).float().cpu()
    assert got.shape == (3 * ql, vocab)
    want = eager(drafts.reshape(-1), [ql] * 3, starts).float().cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if device == "cuda":
        assert runner.replays == 1
