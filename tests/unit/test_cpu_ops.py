"""The lean CPU ops (`metrale.kernels.cpu_ops`) compute their references: bit for bit in
float32 for the norms and the q/k norm + rotary + KV write (fused-QKV views and separate
tensors alike), the decode attention of several sequences and, to rounding, of one sequence
read without a mask; every case they do not cover (bfloat16, a float8 cache, partial rotary,
prefill rows) returns exactly the reference's result; `kernels_for(cpu)` selects them and
`METRALE_CPU_OPS=torch` turns them off."""

from __future__ import annotations

import pytest
import torch

from metrale.kernels import cpu_ops, kernels_for, reference, sampling_reference
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.rotary import RotaryEmbedding
from metrale.model_config import RopeConfig

HQ, HK, D, BLOCK = 4, 2, 16, 4


def _meta(lens: list[int], qlens: list[int], nd: int, tables: torch.Tensor) -> AttentionMetadata:
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        positions=torch.zeros(starts[-1], dtype=torch.int64),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decode=nd,
        query_lens_host=qlens,
        seq_lens_host=lens,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_start_loc_host=starts,
    )


def test_rms_norms_equal_the_reference_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g)
    w = torch.randn(96, generator=g)
    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    got, want = cpu_ops.add_rms_norm(x, res, w, 1e-5), reference.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_ops.rms_norm(xb, wb, 1e-6), reference.rms_norm(xb, wb, 1e-6))


def _qkv(tokens: int, fused: bool, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(tokens + fused)
    if fused:  # the attention layer's split of the fused projection: views of one tensor
        qkv = torch.randn(tokens, (HQ + 2 * HK) * D, generator=g).to(dtype)
        q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
        return q.view(tokens, HQ, D), k.view(tokens, HK, D), v.view(tokens, HK, D)
    return (
        torch.randn(tokens, HQ, D, generator=g).to(dtype),
        torch.randn(tokens, HK, D, generator=g).to(dtype),
        torch.randn(tokens, HK, D, generator=g).to(dtype),
    )


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_rotary_write_kv_equals_the_reference_bit_for_bit(fused: bool, qk_norm: bool) -> None:
    tokens = 6
    q, k, v = _qkv(tokens, fused)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), D, 64)
    positions = torch.tensor([0, 5, 6, 7, 30, 63])
    slots = torch.tensor([3, 9, 10, 11, 17, 30])
    qw, kw = torch.randn(D), torch.randn(D)
    results = []
    for impl in (reference, cpu_ops.CpuOps()):
        caches = torch.zeros(2, 8, BLOCK, HK, D)
        if qk_norm:
            out = impl.qk_norm_rotary_write_kv(
                positions, q, k, v, qw, kw, 1e-6, rotary.cos_sin, D, caches[0], caches[1], slots
            )
        else:
            out = impl.rotary_write_kv(
                positions, q, k, v, rotary.cos_sin, D, caches[0], caches[1], slots
            )
        results.append((out, caches))
    (want, want_caches), (got, got_caches) = results
    assert torch.equal(got, want) and torch.equal(got_caches, want_caches)


def test_rotary_table_follows_its_table() -> None:
    """A table grown (a new tensor) or changed in place is never served stale."""
    ops = cpu_ops.CpuOps()
    q, k, v = _qkv(1, True)
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), D, 8)
    pos, slots = torch.tensor([3]), torch.tensor([1])

    def run(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        caches = torch.zeros(2, 2, BLOCK, HK, D)
        got = ops.rotary_write_kv(pos, q, k, v, table, D, caches[0], caches[1], slots)
        caches_ref = torch.zeros(2, 2, BLOCK, HK, D)
        want = reference.rotary_write_kv(
            pos, q, k, v, table, D, caches_ref[0], caches_ref[1], slots
        )
        return got - want, caches - caches_ref

    assert all(not d.any() for d in run(rotary.cos_sin))
    rotary.cos_sin.mul_(0.5)
    assert all(not d.any() for d in run(rotary.cos_sin))
    rotary.ensure_positions(100)
    assert all(not d.any() for d in run(rotary.cos_sin))
    with torch.inference_mode():  # a per-forward table (M-RoPE's) has no version counter
        table = rotary.cos_sin * 1.5
        assert all(not d.any() for d in run(table))


def test_uncovered_cases_run_the_reference() -> None:
    ops = cpu_ops.CpuOps()
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), D, 16)
    pos, slots = torch.tensor([1, 2]), torch.tensor([4, 5])
    for dtype, rotary_dim in ((torch.bfloat16, D), (torch.float32, D // 2)):
        q, k, v = _qkv(2, True, dtype)
        outs = []
        for impl in (reference, ops):
            caches = torch.zeros(2, 2, BLOCK, HK, D, dtype=dtype)
            table = rotary.cos_sin[:, :, : rotary_dim // 2].contiguous()
            out = impl.rotary_write_kv(pos, q, k, v, table, rotary_dim, caches[0], caches[1], slots)
            outs.append((out, caches))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("lens", [[7], [13, 4, 9]])
def test_decode_attention_equals_the_reference(lens: list[int]) -> None:
    g = torch.Generator().manual_seed(len(lens))
    k_cache = torch.randn(12, BLOCK, HK, D, generator=g)
    v_cache = torch.randn(12, BLOCK, HK, D, generator=g)
    tables = torch.tensor([[5, 2, 9, 1], [3, 0, 0, 0], [7, 11, 4, 0]], dtype=torch.int32)
    tables = tables[: len(lens)]
    meta = _meta(lens, [1] * len(lens), len(lens), tables)
    q = torch.randn(len(lens), HQ, D, generator=g)
    want = reference.paged_attention(q, k_cache, v_cache, meta, D**-0.5)
    for _ in range(2):  # the second layer reads the forward's memo
        got = cpu_ops.paged_attention(q, k_cache, v_cache, meta, D**-0.5)
        if len(lens) > 1:
            assert torch.equal(got, want)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert ("cpu_decode", BLOCK) in meta.memo


@pytest.mark.parametrize("threads", [1, 2])
def test_c_decode_attention_equals_the_reference(threads: int) -> None:
    """`CpuOps.paged_attention` (the C kernel: blocks read in place, the KV head's reads
    shared by its query heads) equals the reference to float32 rounding, with a q that is a
    view into a wider fused-QKV row, on one thread and on two; prefill rows and a bfloat16
    cache still run the reference's result."""
    ops = cpu_ops.CpuOps()
    if ops._attention is None:
        pytest.skip("the C library cannot be built here")
    g = torch.Generator().manual_seed(3)
    k_cache = torch.randn(40, BLOCK, HK, D, generator=g) * 3  # wide scores: exp's range
    v_cache = torch.randn(40, BLOCK, HK, D, generator=g)
    lens = [37, 4, 19]  # 16-position chunks of the vector exp and scalar tails
    tables = torch.randperm(40, generator=g)[:30].view(3, 10).to(torch.int32)
    meta = _meta(lens, [1, 1, 1], 3, tables)
    qkv = torch.randn(3, (HQ + 2 * HK) * D, generator=g)
    q = qkv[:, : HQ * D].view(3, HQ, D)
    want = reference.paged_attention(q, k_cache, v_cache, meta, D**-0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = ops.paged_attention(q, k_cache, v_cache, meta, D**-0.5)
    finally:
        torch.set_num_threads(before)
    assert "cpu_c_attention" in meta.memo
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    prefill = _meta([9, 6], [1, 3], 1, torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32))
    q4 = torch.randn(4, HQ, D, generator=g)
    want = reference.paged_attention(q4, k_cache, v_cache, prefill, D**-0.5)
    assert torch.equal(ops.paged_attention(q4, k_cache, v_cache, prefill, D**-0.5), want)


@pytest.mark.parametrize("vocab", [512, 1000, 151936])
def test_c_greedy_logprobs_equals_the_reference(vocab: int) -> None:
    """`CpuOps.greedy_logprobs` (the C kernel) against `sampling_reference.greedy_logprobs`:
    the same tokens (ties to the lowest id, NaN as -inf, +inf as the float32 max), ranks and
    samplable flags, logprobs to float32 rounding, on rows read through a stride (a view of
    wider logits), a row without a finite logit, and other dtypes by the reference."""
    ops = cpu_ops.CpuOps()
    if ops._greedy is None:
        pytest.skip("the C library cannot be built here")
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(7, vocab + 9, generator=g) * 4
    logits = wide[:, :vocab]  # stride vocab + 9, each row contiguous
    logits[1, 5] = logits[1, 900 % vocab] = logits[1].max() + 1  # a tie: the lower id wins
    logits[2, 3] = float("nan")
    logits[2, vocab - 1] = float("inf")  # +inf reads as the float32 max, the argmax
    logits[3] = float("-inf")  # no finite logit: id 0, logprob -inf, not samplable
    logits[4, :] = float("nan")
    logits[5, vocab - 2] = 80.0  # one dominant logit: logprob near 0
    want_ids, want = sampling_reference.greedy_logprobs(logits)
    ids, packed = ops.greedy_logprobs(logits)
    assert torch.equal(ids, want_ids)
    assert torch.equal(packed[:, [0, 2, 3]], want[:, [0, 2, 3]])
    torch.testing.assert_close(packed[:, 1], want[:, 1], rtol=1e-5, atol=1e-5)
    assert packed[3, 1] == float("-inf") and packed[4, 1] == float("-inf")
    assert ids[1] == 5 and ids[2] == vocab - 1 and ids[3] == 0
    half = logits.to(torch.bfloat16)
    for got, ref in zip(ops.greedy_logprobs(half), sampling_reference.greedy_logprobs(half)):
        assert torch.equal(got, ref)


def test_prefill_rows_run_the_reference() -> None:
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(6, BLOCK, HK, D, generator=g)
    v_cache = torch.randn(6, BLOCK, HK, D, generator=g)
    meta = _meta([9, 6], [1, 3], 1, torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32))
    q = torch.randn(4, HQ, D, generator=g)
    want = reference.paged_attention(q, k_cache, v_cache, meta, D**-0.5)
    assert torch.equal(cpu_ops.paged_attention(q, k_cache, v_cache, meta, D**-0.5), want)
    assert not meta.memo


def test_kernels_for_cpu_selects_the_lean_ops_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ops = kernels_for(torch.device("cpu"))
    assert ops.rms_norm is cpu_ops.rms_norm and ops.implementations["rms_norm"] == "cpu-lean"
    assert ops.paged_attention.__func__ is cpu_ops.CpuOps.paged_attention
    assert ops.greedy_logprobs.__func__ is cpu_ops.CpuOps.greedy_logprobs
    monkeypatch.setenv("METRALE_CPU_OPS", "torch")
    plain = kernels_for(torch.device("cpu"))
    assert plain.rms_norm is reference.rms_norm and plain.implementations["rms_norm"] == "torch"
    assert plain.qk_norm_rotary_write_kv is reference.qk_norm_rotary_write_kv


@pytest.mark.parametrize("vocab", [512, 1000])
def test_c_stop_masked_greedy_equals_the_reference_bit_for_bit(
    vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`CpuOps.stop_masked_greedy` (torch's logsumexp, then the C kernel) against
    `sampling_reference.stop_masked_greedy`: every packed value equal, logprobs included: a
    banned argmax (the next logit wins, rank 2), ties, -inf logits, a row whose only finite
    logits are banned (the raw argmax, not samplable), a row without a finite logit, rows
    banning nothing; logits with a NaN or +inf, strided logits and other dtypes run the
    reference itself."""
    ops = cpu_ops.CpuOps()
    if ops._stop_masked is None:
        pytest.skip("the C library cannot be built here")
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(8, vocab, generator=g) * 4
    banned = [[2], [2], [2, 7], [1, 2], [3], [], [2], [0, 9]]
    logits[0, 2] = logits[0].max() + 1  # the banned argmax: the next one wins
    logits[1, 5] = logits[1, 300] = logits[1].max() + 1  # a tie: the lower id
    logits[2, 11] = logits[2, 40] = float("-inf")
    logits[3, :] = float("-inf")
    logits[3, 1] = 4.0  # only banned finite logits: the raw argmax, not samplable
    logits[4, :] = float("-inf")  # no finite logit: logprob -inf
    logits[6, 2] = 90.0
    logits[7, 0] = logits[7, 9] = logits[7].max() + 2  # both maxima banned
    want_ids, want = sampling_reference.stop_masked_greedy(logits, banned)
    with monkeypatch.context() as patched:  # the clean batch never reaches the reference
        patched.setattr(sampling_reference, "stop_masked_greedy", None)
        ids, packed = ops.stop_masked_greedy(logits, banned)
    assert torch.equal(ids, want_ids) and torch.equal(packed, want)
    assert want[0, 0] != 2 and want[0, 2] == 2 and ids[1] == 5
    assert want[3, 3] == 0 and ids[3] == 1 and want[4, 1] == float("-inf") and ids[4] == 0
    dirty = logits.clone()
    dirty[2, 7] = float("inf")
    dirty[5, 11] = float("nan")
    wide = torch.cat([logits, logits[:, :5]], dim=1)[:, :vocab]
    for other in (dirty, wide, logits.to(torch.bfloat16)):
        got = ops.stop_masked_greedy(other, banned)
        ref = sampling_reference.stop_masked_greedy(other, banned)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
