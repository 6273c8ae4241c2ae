"""Every Triton kernel against its torch reference (`metrale.kernels.reference`).

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1` (tiny shapes; the CUDA-graph test needs a GPU). References run in
float64 on the CPU where they can; errors are `||out - ref|| / ||ref||` against per-dtype
bounds. Outputs are poisoned (NaN) before each launch so an unwritten element fails, and
cache memory no sequence owns holds large garbage so a read outside the context shows.
"""

from __future__ import annotations

import math
import os
from types import ModuleType

import pytest
import torch

# Without CUDA or the interpreter, conftest.py skips this module before it is imported.
pytest.importorskip("triton")

from metrale.kernels import reference
from metrale.kernels import triton_attention as ta
from metrale.kernels import triton_norm as tn
from metrale.kernels import triton_rotary as tr
from metrale.kernels import triton_sampling as ts
from metrale.kernels.metadata import AttentionMetadata

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

#: Relative error bounds by dtype (float64 reference).
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Large finite garbage in cache slots no sequence owns: a kernel reading one is far off.
GARBAGE = 300.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.detach().double().cpu()
    ref64 = ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), "non-finite (unwritten or NaN) output elements"
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


# -------------------------------------------------------------------------------------------
# Norms, activation
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 200])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    g = gen(1)
    x = randn(7, hidden, dtype=dtype, g=g, scale=3.0)
    w = randn(hidden, dtype=dtype, g=g)
    out = tn.rms_norm(x, w, 1e-6)
    ref = reference.rms_norm(x.cpu().double(), w.cpu().double(), 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) < TOL[dtype]
    # Same function as the reference in the input dtype (rounding before the weight).
    assert rel_err(out, reference.rms_norm(x.cpu(), w.cpu(), 1e-6)) < TOL[dtype] / 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_view(dtype: torch.dtype) -> None:
    """The q/k norm path: a `[T, H, D]` view into a fused projection (non-contiguous)."""
    g = gen(2)
    qkv = randn(5, 4 * 16 + 2 * 2 * 16, dtype=dtype, g=g)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    w = randn(16, dtype=dtype, g=g)
    out = tn.rms_norm(q, w, 1e-6)
    assert rel_err(out, reference.rms_norm(q.cpu().double(), w.cpu().double(), 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    g = gen(3)
    x = randn(9, 96, dtype=dtype, g=g)
    r = randn(9, 96, dtype=dtype, g=g, scale=4.0)
    w = randn(96, dtype=dtype, g=g)
    x_before, r_before = x.clone(), r.clone()
    out, summed = tn.add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_sum = reference.add_rms_norm(x.cpu(), r.cpu(), w.cpu(), 1e-5)
    ref64_out, ref64_sum = reference.add_rms_norm(
        x.cpu().double(), r.cpu().double(), w.cpu().double(), 1e-5
    )
    assert torch.equal(summed.cpu(), ref_sum), "the residual sum is rounded like the reference"
    assert rel_err(summed, ref64_sum) < TOL[dtype]
    assert rel_err(out, ref64_out) < TOL[dtype]
    assert rel_err(out, ref_out) < TOL[dtype] / 4
    assert torch.equal(x, x_before) and torch.equal(r, r_before), "inputs are not written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 256])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    g = gen(4)
    x = randn(6, 2 * inter, dtype=dtype, g=g, scale=3.0)
    out = tn.silu_and_mul(x)
    assert out.shape == (6, inter) and out.dtype == dtype
    assert rel_err(out, reference.silu_and_mul(x.cpu().double())) < TOL[dtype]
    assert rel_err(out, reference.silu_and_mul(x.cpu())) < TOL[dtype] / 4


# -------------------------------------------------------------------------------------------
# Rotary (+ q/k norm)
# -------------------------------------------------------------------------------------------


def _cos_sin(rotary_dim: int, positions: int) -> torch.Tensor:
    from metrale.layers.rotary import RotaryEmbedding
    from metrale.models.config import RopeConfig

    rope = RopeConfig(theta=10000.0, partial_rotary_factor=1.0)
    layer = RotaryEmbedding(rope, rotary_dim, positions)
    return layer.cos_sin.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(32, 32), (32, 16), (24, 16)])
@pytest.mark.parametrize("norm", [False, True])
def test_rotary(dtype: torch.dtype, head_dim: int, rotary_dim: int, norm: bool) -> None:
    g = gen(5)
    tokens, hq, hk = 6, 4, 2
    qkv = randn(tokens, (hq + 2 * hk) * head_dim, dtype=dtype, g=g, scale=2.0)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    positions = torch.tensor([0, 5, 17, 3, 63, 40], dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(rotary_dim, 64)
    if norm:
        qw, kw = randn(head_dim, dtype=dtype, g=g), randn(head_dim, dtype=dtype, g=g)
        q_out, k_out = tr.qk_norm_rotary(positions, q, k, qw, kw, 1e-6, cos_sin, rotary_dim)
        args64 = (qw.cpu().double(), kw.cpu().double(), 1e-6)
        q_ref, k_ref = reference.qk_norm_rotary(
            positions.cpu(), q.cpu().double(), k.cpu().double(), *args64,
            cos_sin.cpu().double(), rotary_dim,
        )  # fmt: skip
    else:
        q_out, k_out = tr.rotary_embedding(positions, q, k, cos_sin, rotary_dim)
        q_ref, k_ref = reference.rotary_embedding(
            positions.cpu(), q.cpu().double(), k.cpu().double(), cos_sin.cpu().double(), rotary_dim
        )
    assert q_out.dtype == dtype and q_out.shape == q.shape and k_out.shape == k.shape
    assert rel_err(q_out, q_ref) < TOL[dtype]
    assert rel_err(k_out, k_ref) < TOL[dtype]


# -------------------------------------------------------------------------------------------
# Paged KV: write and attention
# -------------------------------------------------------------------------------------------


class PagedBatch:
    """A batch of sequences over a shuffled block pool, with its metadata and caches."""

    def __init__(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_decode: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int,
        extra_table_blocks: int = 2,
        decode_query_len: int = 1,
    ) -> None:
        g = gen(seed)
        self.block_size = block_size
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = 1 + sum(blocks_per_seq) + 3
        pool = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        max_blocks = max(max(blocks_per_seq, default=0), 1) + extra_table_blocks
        # Table entries past a sequence's blocks hold other sequences' blocks (never read).
        tables = torch.randint(1, num_blocks, (len(seq_lens), max_blocks), generator=g)
        for b, n in enumerate(blocks_per_seq):
            tables[b, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int64)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        k_cache = torch.full(shape, GARBAGE, dtype=torch.float64)
        v_cache = torch.full(shape, -GARBAGE, dtype=torch.float64)
        for b, n in enumerate(seq_lens):  # real K/V only at positions a sequence owns
            for pos in range(n):
                blk, off = tables[b, pos // block_size], pos % block_size
                k_cache[blk, off] = torch.randn(kv_heads, head_dim, generator=g)
                v_cache[blk, off] = torch.randn(kv_heads, head_dim, generator=g)
        self.k_cache = k_cache.to(dtype).to(DEVICE)
        self.v_cache = v_cache.to(dtype).to(DEVICE)
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
        rows = [b for b, q in enumerate(query_lens) for _ in range(q)]
        slots = [int(tables[b, p // block_size]) * block_size + p % block_size
                 for b, p in zip(rows, positions)]  # fmt: skip
        self.meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(torch.int32).to(DEVICE),
            num_decode=num_decode,
            query_lens_host=list(query_lens),
            seq_lens_host=list(seq_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_host=qsl,
            decode_query_len=decode_query_len,
        )

    def meta_cpu(self) -> AttentionMetadata:
        m = self.meta
        return AttentionMetadata(
            positions=m.positions.cpu(),
            slot_mapping=m.slot_mapping.cpu(),
            query_start_loc=m.query_start_loc.cpu(),
            seq_lens=m.seq_lens.cpu(),
            block_tables=m.block_tables.cpu(),
            num_decode=m.num_decode,
            query_lens_host=m.query_lens_host,
            seq_lens_host=m.seq_lens_host,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc_host=m.query_start_loc_host,
            decode_query_len=m.decode_query_len,
        )


def _reference_attention(
    batch: PagedBatch, q: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    return reference.paged_attention(
        q.cpu().double(),
        batch.k_cache.cpu().double(),
        batch.v_cache.cpu().double(),
        batch.meta_cpu(),
        scale,
        window,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv(dtype: torch.dtype, block_size: int) -> None:
    g = gen(6)
    batch = PagedBatch([1, 1, 7, 20], [9, 33, 7, 50], 2, block_size, 2, 16, dtype, seed=6)
    tokens = batch.meta.slot_mapping.shape[0]
    # K and V as views into a fused projection, like the attention layer passes them.
    kv = randn(tokens, 2 * 2 * 16 + 8, dtype=dtype, g=g)
    k = kv[:, :32].view(tokens, 2, 16)
    v = kv[:, 32:64].view(tokens, 2, 16)
    k_ref, v_ref = batch.k_cache.cpu().clone(), batch.v_cache.cpu().clone()
    reference.write_kv(k.cpu(), v.cpu(), k_ref, v_ref, batch.meta.slot_mapping.cpu())
    ta.write_kv(k, v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.k_cache.cpu(), k_ref)
    assert torch.equal(batch.v_cache.cpu(), v_ref)


def test_write_kv_skips_negative_slots() -> None:
    g = gen(7)
    k_cache = torch.zeros(3, 16, 1, 16, device=DEVICE)
    v_cache = torch.zeros(3, 16, 1, 16, device=DEVICE)
    k = randn(3, 1, 16, dtype=torch.float32, g=g)
    slots = torch.tensor([17, -1, 0], dtype=torch.int64, device=DEVICE)
    ta.write_kv(k, k, k_cache, v_cache, slots)
    flat = k_cache.view(-1, 1, 16)
    assert torch.equal(flat[17], k[0]) and torch.equal(flat[0], k[2])
    assert int((flat.abs().sum(dim=(1, 2)) > 0).sum()) == 2


# -------------------------------------------------------------------------------------------
# Rotary (+ q/k norm) fused with the KV write
# -------------------------------------------------------------------------------------------

FUSED_CASES = [
    # (query_lens, seq_lens, num_decode, q_heads, kv_heads, head_dim, rotary_dim)
    ([1], [9], 1, 4, 1, 64, 64),  # batch-1 decode, GQA group 4
    ([1, 1, 7, 20], [9, 33, 7, 50], 2, 8, 2, 128, 128),  # mixed decode + prefill
    ([1, 3, 5], [40, 3, 21], 1, 6, 3, 64, 32),  # partial rotary, non-power-of-2 heads
    ([2, 1, 4], [18, 1, 37], 0, 4, 4, 128, 64),  # partial rotary, no GQA
]


def _unfused(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor] | None,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The two-launch path the fused op replaces: Triton rotary, then Triton `write_kv`."""
    if weights is None:
        q_out, k_out = tr.rotary_embedding(positions, q, k, cos_sin, rotary_dim)
    else:
        q_out, k_out = tr.qk_norm_rotary(positions, q, k, *weights, 1e-6, cos_sin, rotary_dim)
    ta.write_kv(k_out, v, k_cache, v_cache, slots)
    return q_out


def _fused(
    ops: ModuleType,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor] | None,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`ops.rotary_write_kv` or `ops.qk_norm_rotary_write_kv` (`ops`: `tr` or `reference`)."""
    cache = (k_cache, v_cache, slots)
    if weights is None:
        return ops.rotary_write_kv(positions, q, k, v, cos_sin, rotary_dim, *cache)
    return ops.qk_norm_rotary_write_kv(
        positions, q, k, v, *weights, 1e-6, cos_sin, rotary_dim, *cache
    )


def _qkv_views(
    tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views into one fused projection output, as the layer passes them."""
    qkv = randn(tokens, (hq + 2 * hk) * d, dtype=dtype, g=g, scale=2.0)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d :].view(tokens, hk, d)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("case", range(len(FUSED_CASES)))
def test_rotary_write_kv(dtype: torch.dtype, norm: bool, case: int) -> None:
    query_lens, seq_lens, num_decode, hq, hk, d, rd = FUSED_CASES[case]
    batch = PagedBatch(query_lens, seq_lens, num_decode, 16, hk, d, dtype, seed=20 + case)
    g = gen(21 + case)
    tokens = sum(query_lens)
    q, k, v = _qkv_views(tokens, hq, hk, d, dtype, g)
    weights = (randn(d, dtype=dtype, g=g), randn(d, dtype=dtype, g=g)) if norm else None
    positions, slots = batch.meta.positions, batch.meta.slot_mapping
    cos_sin = _cos_sin(rd, max(seq_lens))
    before = batch.k_cache.clone(), batch.v_cache.clone()

    # Bit for bit the unfused Triton path (same rounding points, same cache contents).
    k_unf, v_unf = before[0].clone(), before[1].clone()
    q_unf = _unfused(positions, q, k, v, weights, cos_sin, rd, k_unf, v_unf, slots)
    k_cache, v_cache = before[0].clone(), before[1].clone()
    q_out = _fused(tr, positions, q, k, v, weights, cos_sin, rd, k_cache, v_cache, slots)
    assert q_out.dtype == dtype and q_out.shape == q.shape
    assert torch.equal(q_out, q_unf)
    assert torch.equal(k_cache, k_unf) and torch.equal(v_cache, v_unf)

    # Against the reference in float64: q and the written K rows within the dtype's bound, V
    # rows exact, every other cache element untouched.
    cpu64 = [x.cpu().double() for x in (q, k, v)]
    w64 = None if weights is None else tuple(w.cpu().double() for w in weights)
    k_ref, v_ref = before[0].cpu().double(), before[1].cpu().double()
    q_ref = _fused(
        reference, positions.cpu(), *cpu64, w64, cos_sin.cpu().double(), rd, k_ref, v_ref,
        slots.cpu(),
    )  # fmt: skip
    assert rel_err(q_out, q_ref) < TOL[dtype]
    flat_slots = slots.cpu()
    k_rows = k_cache.cpu().view(-1, hk, d)
    v_rows = v_cache.cpu().view(-1, hk, d)
    assert rel_err(k_rows[flat_slots], k_ref.view(-1, hk, d)[flat_slots]) < TOL[dtype]
    assert torch.equal(v_rows[flat_slots], v.cpu())
    untouched = torch.ones(k_rows.shape[0], dtype=torch.bool)
    untouched[flat_slots] = False
    assert torch.equal(k_rows[untouched], before[0].cpu().view(-1, hk, d)[untouched])
    assert torch.equal(v_rows[untouched], before[1].cpu().view(-1, hk, d)[untouched])

    # The same function as the reference in the input dtype (its rounding points).
    k_ref, v_ref = before[0].cpu().clone(), before[1].cpu().clone()
    w_cpu = None if weights is None else tuple(w.cpu() for w in weights)
    q_ref = _fused(
        reference, positions.cpu(), q.cpu(), k.cpu(), v.cpu(), w_cpu, cos_sin.cpu(), rd, k_ref,
        v_ref, slots.cpu(),
    )  # fmt: skip
    assert rel_err(q_out, q_ref) < TOL[dtype] / 4
    assert rel_err(k_cache.cpu().view(-1, hk, d)[flat_slots], k_ref.view(-1, hk, d)[flat_slots]) < (
        TOL[dtype] / 4
    )
    assert torch.equal(v_ref, v_cache.cpu())


@pytest.mark.parametrize("norm", [False, True])
def test_rotary_write_kv_padding_slots(norm: bool) -> None:
    """Padded rows as `write_kv` sees them: a slot < 0 writes nothing (q is still written), a
    padded row on the null block 0 writes there."""
    g = gen(22)
    hq, hk, d = 4, 2, 64
    slots = torch.tensor([-1, 17, 0, -1, 40], dtype=torch.int64, device=DEVICE)
    positions = torch.tensor([0, 3, 0, 0, 9], dtype=torch.int64, device=DEVICE)
    q, k, v = _qkv_views(5, hq, hk, d, torch.bfloat16, g)
    weights = (randn(d, dtype=torch.bfloat16, g=g),) * 2 if norm else None
    cos_sin = _cos_sin(d, 16)
    cache = randn(2, 4, 16, hk, d, dtype=torch.bfloat16, g=g)
    k_unf, v_unf = cache[0].clone(), cache[1].clone()
    q_unf = _unfused(positions, q, k, v, weights, cos_sin, d, k_unf, v_unf, slots)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    q_out = _fused(tr, positions, q, k, v, weights, cos_sin, d, k_cache, v_cache, slots)
    assert torch.equal(q_out, q_unf)
    assert torch.equal(k_cache, k_unf) and torch.equal(v_cache, v_unf)
    changed = (v_cache != cache[1]).flatten(2).any(-1).flatten()
    assert changed.nonzero().flatten().tolist() == [0, 17, 40]


@pytest.mark.parametrize(
    ("in_dtype", "weight_dtype", "cache_dtype"),
    [
        (torch.bfloat16, torch.bfloat16, torch.float32),  # k rounded to bf16, then widened
        (torch.float32, torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.float16),  # fp32 weights promote k to fp32
    ],
)
def test_rotary_write_kv_cache_dtype(
    in_dtype: torch.dtype, weight_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """A cache dtype other than k's: the fused op rounds k to the unfused op's output dtype
    before the cache cast, as rotary + `write_kv` do."""
    g = gen(23)
    hq, hk, d, rd = 4, 2, 64, 32
    slots = torch.tensor([5, 17, 2], dtype=torch.int64, device=DEVICE)
    positions = torch.tensor([7, 3, 1], dtype=torch.int64, device=DEVICE)
    q, k, v = _qkv_views(3, hq, hk, d, in_dtype, g)
    weights = (randn(d, dtype=weight_dtype, g=g), randn(d, dtype=weight_dtype, g=g))
    cos_sin = _cos_sin(rd, 16)
    for w in (None, weights):
        cache = randn(2, 2, 16, hk, d, dtype=cache_dtype, g=g)
        k_unf, v_unf = cache[0].clone(), cache[1].clone()
        q_unf = _unfused(positions, q, k, v, w, cos_sin, rd, k_unf, v_unf, slots)
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        q_out = _fused(tr, positions, q, k, v, w, cos_sin, rd, k_cache, v_cache, slots)
        assert q_out.dtype == q_unf.dtype and torch.equal(q_out, q_unf)
        assert torch.equal(k_cache, k_unf) and torch.equal(v_cache, v_unf)


LONG = 300 if INTERPRET else 5000

DECODE_CASES = [
    # (seq_lens, kv_heads, group, head_dim); 0 = a padded row
    ([5, 16, 33, 0, 47], 2, 2, 32),
    ([1, LONG, 77, 0], 1, 4, 16),
    ([LONG + 13, 3, 130], 2, 3, 32),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_attention(
    dtype: torch.dtype, block_size: int, window: int | None, case: int
) -> None:
    seq_lens, kv_heads, group, head_dim = DECODE_CASES[case]
    batch = PagedBatch(
        [1] * len(seq_lens), seq_lens, len(seq_lens), block_size, kv_heads, head_dim, dtype, 11
    )
    g = gen(12 + case)
    q = randn(len(seq_lens), kv_heads * group, head_dim, dtype=dtype, g=g)
    scale = head_dim**-0.5
    ref = _reference_attention(batch, q, scale, window)
    real = [i for i, n in enumerate(seq_lens) if n > 0]
    splits_tried = [None, 1, 4] if not INTERPRET else [None, 4]
    for splits in splits_tried:
        out = poisoned(tuple(q.shape), dtype)
        ta.decode_attention(
            q, batch.k_cache, batch.v_cache, batch.meta.seq_lens, batch.meta.block_tables,
            scale, window, out=out, num_splits=splits,
            min_split_tokens=None if splits is None else 32,
        )  # fmt: skip
        assert rel_err(out[real], ref[real]) < TOL[dtype], f"num_splits={splits}"
        padded = [i for i, n in enumerate(seq_lens) if n == 0]
        assert torch.isfinite(out[padded].float()).all()
        assert (out[padded] == 0).all(), "an empty row writes zeros"


MIXED_CASES = [
    # (query_lens, seq_lens, num_decode): decode rows first, then chunks (some after a prefix)
    ([1, 1, 1, 9, 21], [1, 40, 17, 9, 21], 3),
    ([1, 5, 1, 33], [70, 45, 18, 33 + 19], 1),
    ([12, 3, 40], [12, 3 + 50, 40 + 16], 0),
    # prefill chunks of one token each (prefix hits up to the last token): the decode kernel
    ([1, 1, 1], [33, 1, 200], 1),
    ([1], [150], 0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize(
    ("case", "kv_heads", "group"), [(0, 2, 2), (1, 1, 4), (2, 2, 3), (3, 2, 2), (4, 1, 4)]
)
def test_paged_attention_mixed(
    dtype: torch.dtype,
    block_size: int,
    window: int | None,
    case: int,
    kv_heads: int,
    group: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    query_lens, seq_lens, num_decode = MIXED_CASES[case]
    head_dim = 32
    batch = PagedBatch(query_lens, seq_lens, num_decode, block_size, kv_heads, head_dim, dtype, 21)
    g = gen(22 + case)
    q = randn(sum(query_lens), kv_heads * group, head_dim, dtype=dtype, g=g)
    scale = head_dim**-0.5
    ref = _reference_attention(batch, q, scale, window)
    calls: list[int] = []
    prefill = ta.prefill_attention
    monkeypatch.setattr(
        ta, "prefill_attention", lambda *a, **k: calls.append(1) or prefill(*a, **k)
    )
    out = ta.paged_attention(q, batch.k_cache, batch.v_cache, batch.meta, scale, window)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    assert bool(calls) == (max(query_lens[num_decode:], default=0) > 1)  # 1-token chunks: decode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_tiles_and_rows(dtype: torch.dtype) -> None:
    """Several query tiles per chunk and several key tiles, with small tiles forced."""
    query_lens, seq_lens = [37, 1, 20], [37 + 30, 9, 20]
    batch = PagedBatch(query_lens, seq_lens, 0, 16, 2, 32, dtype, 31)
    q = randn(sum(query_lens), 4, 32, dtype=dtype, g=gen(32))
    out = poisoned(tuple(q.shape), dtype)
    ta.prefill_attention(
        q, batch.k_cache, batch.v_cache, batch.meta, 0.2, None, out, 0, block_m=16, block_n=16
    )
    assert rel_err(out, _reference_attention(batch, q, 0.2, None)) < TOL[dtype]


def _verify_seq_lens(ql: int) -> list[int]:
    """Context lengths of a verify batch: the Q rows inside one block, across a block
    boundary, across a tile boundary, a padded sequence (0: zeros), a long context over
    several splits, and a context exactly Q long (the first row sees one key)."""
    return [ql + 3, 16 + ql // 2, 33, 0, LONG + 7, ql]


def _run_verify(
    dtype: torch.dtype, ql: int, group: int, window: int | None, kv_heads: int = 2,
    head_dim: int = 32, splits_tried: tuple[int | None, ...] = (None, 4),
) -> None:  # fmt: skip
    seq_lens = _verify_seq_lens(ql)
    seqs = len(seq_lens)
    batch = PagedBatch([ql] * seqs, seq_lens, seqs, 16, kv_heads, head_dim, dtype, 13,
                       decode_query_len=ql)  # fmt: skip
    q = randn(seqs * ql, kv_heads * group, head_dim, dtype=dtype, g=gen(14 + ql))
    scale = head_dim**-0.5
    ref = _reference_attention(batch, q, scale, window)
    real = [b * ql + j for b, n in enumerate(seq_lens) if n > 0 for j in range(ql)]
    padded = [b * ql + j for b, n in enumerate(seq_lens) if n == 0 for j in range(ql)]
    for splits in splits_tried:
        out = poisoned(tuple(q.shape), dtype)
        ta.decode_attention(
            q, batch.k_cache, batch.v_cache, batch.meta.seq_lens, batch.meta.block_tables,
            scale, window, out=out, num_splits=splits,
            min_split_tokens=None if splits is None else 32, query_len=ql,
        )  # fmt: skip
        assert rel_err(out[real], ref[real]) < TOL[dtype], f"num_splits={splits}"
        assert (out[padded] == 0).all(), "an empty sequence writes zeros"
    # The same rows through the mixed entry point, with a prefill chunk after them.
    mixed = PagedBatch([ql, ql, 9], [40, ql + 1, 9 + 20], 2, 16, kv_heads, head_dim, dtype,
                       15, decode_query_len=ql)  # fmt: skip
    qm = randn(2 * ql + 9, kv_heads * group, head_dim, dtype=dtype, g=gen(16))
    out = ta.paged_attention(qm, mixed.k_cache, mixed.v_cache, mixed.meta, scale, window)
    assert rel_err(out, _reference_attention(mixed, qm, scale, window)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("ql", [1, 2, 5])
def test_verify_decode_attention(
    dtype: torch.dtype, ql: int, group: int, window: int | None
) -> None:
    """Q query rows per sequence (a speculative verify step), causal among themselves,
    against the torch reference: single and forced splits, then the mixed entry point."""
    _run_verify(dtype, ql, group, window)


def test_verify_decode_attention_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows per KV head than one program holds: dealt over several programs."""
    from metrale.kernels import triton_decode

    monkeypatch.setattr(triton_decode, "MAX_BLOCK_H", 16)
    _run_verify(torch.float32, 5, 4, None, splits_tried=(None,))  # 20 rows: 2 programs
    _run_verify(torch.bfloat16, 9, 2, 6, kv_heads=1, splits_tried=(4,))  # 18 rows


def test_verify_decode_attention_rejects_ragged_rows() -> None:
    batch = PagedBatch([2, 2], [5, 9], 2, 16, 1, 16, torch.float32, 17, decode_query_len=2)
    q = randn(3, 2, 16, dtype=torch.float32, g=gen(18))
    with pytest.raises(ValueError, match="multiple of query_len"):
        ta.decode_attention(q, batch.k_cache, batch.v_cache, batch.meta.seq_lens,
                            batch.meta.block_tables, 0.25, query_len=2)  # fmt: skip


@pytest.mark.gpu
def test_decode_attention_cuda_graph_replay() -> None:
    """Capture decode attention once, replay it with new lengths and block tables."""
    if INTERPRET:
        pytest.skip("CUDA graphs need a GPU")
    dtype, block_size, kv_heads, group, head_dim = torch.bfloat16, 16, 2, 4, 64
    rows, max_blocks = 4, 96  # capacity 1536 tokens per row
    first = PagedBatch([1] * rows, [100, 1500, 7, 0], rows, block_size, kv_heads, head_dim,
                       dtype, 41, extra_table_blocks=max_blocks)  # fmt: skip
    second = PagedBatch([1] * rows, [1400, 3, 0, 999], rows, block_size, kv_heads, head_dim,
                        dtype, 42, extra_table_blocks=max_blocks)  # fmt: skip
    nb = max(first.k_cache.shape[0], second.k_cache.shape[0])
    k_cache = torch.zeros(nb, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = torch.empty(rows, kv_heads * group, head_dim, dtype=dtype, device=DEVICE)
    seq_lens = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)

    def load(batch: PagedBatch, seed: int) -> torch.Tensor:
        k_cache.zero_()
        v_cache.zero_()
        k_cache[: batch.k_cache.shape[0]].copy_(batch.k_cache)
        v_cache[: batch.v_cache.shape[0]].copy_(batch.v_cache)
        q.copy_(randn(*q.shape, dtype=dtype, g=gen(seed)))
        seq_lens.copy_(batch.meta.seq_lens)
        tables.copy_(batch.meta.block_tables[:, :max_blocks])
        out.fill_(float("nan"))
        return q.clone()

    def run() -> None:
        ta.decode_attention(q, k_cache, v_cache, seq_lens, tables, 0.125, None, out=out)

    load(first, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for batch, seed in ((first, 1), (second, 2)):
        q_now = load(batch, seed)
        graph.replay()
        torch.cuda.synchronize()
        ref_batch = batch
        ref_batch.k_cache, ref_batch.v_cache = k_cache.clone(), v_cache.clone()
        ref = _reference_attention(ref_batch, q_now, 0.125, None)
        real = [i for i, n in enumerate(batch.meta.seq_lens_host) if n > 0]
        assert rel_err(out[real], ref[real]) < TOL[dtype]
        padded = [i for i, n in enumerate(batch.meta.seq_lens_host) if n == 0]
        assert (out[padded] == 0).all()


# -------------------------------------------------------------------------------------------
# Sampler hot path
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax(dtype: torch.dtype) -> None:
    g = gen(51)
    vocab = 5000 if INTERPRET else 151_936
    x = randn(6, vocab, dtype=dtype, g=g)
    x[1, 10] = x[1, 4000] = 50.0  # a tie: the lower index wins
    x[2] = float("-inf")  # no finite logit
    x[3, :100] = float("nan")  # NaN reads as -inf
    x[4, vocab - 1] = 60.0  # the last (partial) chunk
    ids, values = ts.argmax(x)
    ref_ids, ref_values = reference.argmax(x.cpu())
    assert torch.equal(ids.cpu(), ref_ids)
    assert torch.equal(values.cpu(), ref_values)
    assert ids.tolist()[1] == 10 and ids.tolist()[2] == 0 and ids.tolist()[4] == vocab - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_logprobs(dtype: torch.dtype) -> None:
    g = gen(52)
    vocab = 5000 if INTERPRET else 151_936
    x = randn(7, vocab, dtype=dtype, g=g) * 4
    x[1, 10] = x[1, 4000] = 50.0  # a tie: the lower index wins
    x[2] = float("-inf")  # no finite logit: token 0, logprob -inf, not samplable
    x[3, :100] = float("nan")  # NaN reads as -inf
    x[4, vocab - 1] = 60.0  # the last (partial) chunk
    x[5, 7] = float("inf")  # +inf reads as the float32 max: that token, logprob 0
    x[6, 100:] = float("-inf")  # most of the row masked
    ids, packed = ts.greedy_logprobs(x)
    ref_ids, ref_packed = reference.greedy_logprobs(x.cpu())
    assert torch.equal(ids.cpu(), ref_ids)
    got = packed.cpu()
    assert torch.equal(got[:, [0, 2, 3]], ref_packed[:, [0, 2, 3]])
    assert got[2, 1] == float("-inf") and got[2, 3] == 0.0
    finite = ref_packed[:, 1].isfinite()
    # float32 logsumexp in another order: a few ulps of the row's largest logit
    torch.testing.assert_close(got[finite, 1], ref_packed[finite, 1], rtol=0, atol=2e-5)
    assert ids.tolist()[1] == 10 and ids.tolist()[4] == vocab - 1 and ids.tolist()[5] == 7


def _sampling_rows(batch: int, vocab: int, seed: int, ties: bool) -> torch.Tensor:
    g = gen(seed)
    x = torch.randn(batch, vocab, generator=g) * 2.0
    x[:, :3] += 4.0  # a few likely tokens
    if ties:
        x = torch.round(x * 2) / 2  # many exactly tied logits
    return x


SAMPLING_CASES = {
    "top_k": (20, 1.0, 0.0),
    "top_p": (0, 0.8, 0.0),
    "top_k_top_p": (50, 0.6, 0.0),
    "min_p_top_p": (0, 0.9, 0.05),
    "off": (0, 1.0, 0.0),
    "top_k_1": (1, 1.0, 0.0),
}


@pytest.mark.parametrize("slices", [None, 3])
@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_top_p_sample(case: str, ties: bool, slices: int | None) -> None:
    """Against the full-sort reference, with the rows split over the default number of
    programs and over 3 (tied logits then straddle slice boundaries)."""
    top_k, top_p, min_p = SAMPLING_CASES[case]
    vocab = 700 if INTERPRET else 151_936
    batch = 4 if INTERPRET else 16
    draws = 3 if INTERPRET else 8
    x = _sampling_rows(batch, vocab, 60, ties)
    x[0, 5:] = float("-inf")  # a row with few finite logits
    x[1] = float("-inf")  # no finite logit: unsamplable
    logits = x.repeat(draws, 1)  # the same rows under several uniforms
    rows = logits.shape[0]
    u = torch.rand(rows, generator=gen(61), dtype=torch.float64)
    ks = torch.full((rows,), top_k, dtype=torch.int64)
    ps = torch.full((rows,), top_p, dtype=torch.float32)
    mps = torch.full((rows,), min_p, dtype=torch.float32)
    ref_ids, ref_ok = reference.top_k_top_p_sample(logits, ks, ps, u, mps)
    ids, ok = ts.top_k_top_p_sample(
        logits.to(DEVICE), ks.to(DEVICE), ps.to(DEVICE), u.to(DEVICE), mps.to(DEVICE),
        slices=slices,
    )  # fmt: skip
    assert torch.equal(ok.cpu(), ref_ok)
    assert torch.equal(ids.cpu(), ref_ids)
    # The launch hints, given truthfully, skip the unused searches and change nothing.
    hinted, _ = ts.top_k_top_p_sample(
        logits.to(DEVICE), ks.to(DEVICE), ps.to(DEVICE), u.to(DEVICE), mps.to(DEVICE),
        has_top_k=0 < top_k < vocab, has_top_p=top_p < 1.0, slices=slices,
    )  # fmt: skip
    assert torch.equal(hinted.cpu(), ref_ids)
    # The exact surviving set and its probabilities.
    ref_probs, ref_ok_f = reference.top_k_top_p_filter(x, ks[:batch], ps[:batch], mps[:batch])
    probs, ok_f = ts.top_k_top_p_filter(
        x.to(DEVICE), ks[:batch].to(DEVICE), ps[:batch].to(DEVICE), mps[:batch].to(DEVICE),
        slices=slices,
    )  # fmt: skip
    assert torch.equal(ok_f.cpu(), ref_ok_f)
    assert torch.equal(probs.cpu() > 0, ref_probs > 0)
    assert rel_err(probs, ref_probs) < 1e-5


@pytest.mark.parametrize("slices", [None, 2])
def test_top_k_top_p_sample_mixed_rows(slices: int | None) -> None:
    """Per-row parameters differ within one launch (the sampler's batches)."""
    vocab = 600 if INTERPRET else 32_000
    logits = _sampling_rows(6, vocab, 70, ties=False)
    ks = torch.tensor([0, 5, 40, 1, vocab, 17])
    ps = torch.tensor([0.5, 1.0, 0.95, 0.3, 0.99, 0.7])
    mps = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.0, 0.02])
    u = torch.tensor([0.01, 0.5, 0.99, 0.3, 0.999999, 0.75], dtype=torch.float64)
    ref_ids, _ = reference.top_k_top_p_sample(logits, ks, ps, u, mps)
    ids, ok = ts.top_k_top_p_sample(
        logits.to(DEVICE), ks.to(DEVICE), ps.to(DEVICE), u.to(DEVICE), mps.to(DEVICE),
        slices=slices,
    )  # fmt: skip
    assert ok.all()
    assert torch.equal(ids.cpu(), ref_ids)
    ref_probs, _ = reference.top_k_top_p_filter(logits, ks, ps, mps)
    probs, _ = ts.top_k_top_p_filter(
        logits.to(DEVICE), ks.to(DEVICE), ps.to(DEVICE), mps.to(DEVICE), slices=slices
    )
    assert torch.equal(probs.cpu() > 0, ref_probs > 0)
    assert rel_err(probs, ref_probs) < 1e-5
