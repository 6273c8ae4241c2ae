"""Multi-LoRA on CUDA: the gather form of `lora_reference.lora_gather_add` as two Triton kernels
over one group of targets that share their input (q/k/v, o, gate/up, down): a split-K shrink
(`x @ A[slot, j].T` for every target j of the group, float32 partial sums per K split) and an
expand that sums the splits, scales by target and adds `xa_j @ B[slot, :, cols_j]` into each
target's columns; each token row reads its adapter through its slot.

Owner: kernels. `lora_gather_add` is the CUDA entry of `KernelOps.lora_gather_add`.

Why this shape: a decode step calls the op once per group and layer (4 x layers launch pairs,
not 7), and the shrink's reduction over the input features is spread over `splits` programs
per row instead of one program walking all of them (at batch 1 that walk, not the bytes, was
the cost: A of a rank-16 group is a few hundred KB, read from L2).

Invariants:
- Computes `lora_reference.lora_gather_add`: rows of slot -1 are neither read nor written, the
  rank dimension is padded to a power of two and masked, accumulation is float32.
- No host read of the slot tensor: the launch depends only on shapes, so the op can be
  captured in a CUDA graph with the slot tensor as a graph input.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from metrale.kernels.lora_reference import LORA_TILE_ROWS as TILE_ROWS
from metrale.kernels.triton_attention_common import pdl_enter, pdl_options

#: Input features per shrink program (a multiple of the K tile), and the most splits per row.
_K_PER_SPLIT = 256
_MAX_SPLITS = 64


class _Geometry(NamedTuple):
    """The launch shape of one group op: targets, rank, feature counts, tile sizes, the K
    splits and the targets' column bounds."""

    targets: int
    rank: int
    fan_in: int
    fan_out: int
    block_r: int
    block_tr: int
    block_k: int
    splits: int
    k_per_split: int
    bounds: tuple[int, int]


def _geometry(
    op: str, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
    widths: tuple[int, ...], block_k: int | None, k_per_split: int, max_splits: int,
) -> _Geometry:  # fmt: skip
    """Check a group op's operands and lay out its launches (`block_k` None: 64 when the
    rank rows are many, else 128)."""
    targets, rank, fan_in = a.shape[1], a.shape[2], a.shape[3]
    fan_out = y.shape[1]
    if not 1 <= targets <= 3 or len(widths) != targets or sum(widths) != fan_out:
        raise ValueError(f"{op}: {targets} targets of widths {widths}, y has {fan_out}")
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(3) != 1 or b_t.stride(2) != 1:
        raise ValueError(f"{op} needs unit-stride rows (x, y, a, b_t)")
    block_r = max(16, triton.next_power_of_2(rank))
    block_tr = triton.next_power_of_2(targets) * block_r
    if block_k is None:
        block_k = 64 if block_tr >= 128 else 128
    splits = min(max_splits, triton.cdiv(fan_in, k_per_split))
    per_split = triton.cdiv(triton.cdiv(fan_in, splits), block_k) * block_k
    cum = [sum(widths[: j + 1]) for j in range(targets)] + [fan_out] * (3 - targets)
    return _Geometry(
        targets, rank, fan_in, fan_out, block_r, block_tr, block_k,
        triton.cdiv(fan_in, per_split), per_split, (cum[0], cum[1]),
    )  # fmt: skip


@triton.jit
def _a_rows(a_ptr, s, R, stride_as, stride_at, stride_ar, T: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_TR: tl.constexpr):  # fmt: skip
    """Slot `s`'s A rows, all targets stacked (`jr = target * BLOCK_R + rank row`): `(jr, row
    pointers, mask of the real rows)`."""
    jr = tl.arange(0, BLOCK_TR)
    j = jr // BLOCK_R
    r = jr % BLOCK_R
    rows = a_ptr + s * stride_as + j.to(tl.int64) * stride_at + r.to(tl.int64) * stride_ar
    return jr, rows, (j < T) & (r < R)


@triton.jit
def _b_tile(b_ptr, s, r, r_mask, n, n_mask, stride_bs, stride_br):
    """Slot `s`'s `[BLOCK_R, BLOCK_N]` tile of B^T (rank rows `r`, output columns `n`)."""
    return tl.load(
        b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )


@triton.jit
def _tile_rows(tiles_ptr, tile, BLOCK_M: tl.constexpr):
    """Tile `tile` of `tiles [num_tiles, 3]` (start row, row count, slot): `(start, slot, row
    offsets, their mask)`."""
    start = tl.load(tiles_ptr + tile * 3)
    count = tl.load(tiles_ptr + tile * 3 + 1)
    s = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    return start, s, m, m < count


@triton.jit
def _lora_shrink(
    x_ptr, a_ptr, slots_ptr, part_ptr,
    K, R, k_per_split, stride_x, stride_as, stride_at, stride_ar,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0)
    sp = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    jr, rows, row_mask = _a_rows(a_ptr, s, R, stride_as, stride_at, stride_ar, T, BLOCK_R,
                                 BLOCK_TR)  # fmt: skip
    row_mask = row_mask & ((jr * 0 + slot) >= 0)  # base rows (slot -1) read nothing
    acc = tl.zeros((BLOCK_TR,), dtype=tl.float32)
    k_start = sp * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = (k < K) & ((k * 0 + slot) >= 0)
        xv = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(
            rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(part_ptr + (t * SPLITS + sp) * BLOCK_TR + jr, acc)


@triton.jit
def _lora_expand(
    part_ptr, b_ptr, slots_ptr, scales_ptr, y_ptr,
    N, R, n1, n2, stride_y, stride_bs, stride_br, stride_ss,
    T: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (n < N) & ((n * 0 + slot) >= 0)  # base rows (slot -1) are not written
    bv = _b_tile(b_ptr, s, r, r_mask, n, n_mask, stride_bs, stride_br).to(tl.float32)
    target = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)  # which target owns column n
    sp = tl.arange(0, SPLITS_P2)
    parts = part_ptr + (t * SPLITS + sp[:, None]) * BLOCK_TR + r[None, :]
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for jj in tl.static_range(T):
        p = tl.load(parts + jj * BLOCK_R, mask=(sp[:, None] < SPLITS) & r_mask[None, :], other=0.0)
        xa = tl.sum(p, axis=0) * tl.load(scales_ptr + s * stride_ss + jj)
        delta = tl.where(target == jj, tl.sum(bv * xa[:, None], axis=0), delta)
    ptr = y_ptr + t * stride_y + n
    yv = tl.load(ptr, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(ptr, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def lora_gather_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, token_slots: torch.Tensor,
    scales: torch.Tensor, widths: tuple[int, ...], pdl: bool = False,
) -> None:  # fmt: skip
    """`lora_reference.lora_gather_add` (see there) by the shrink and expand kernels; with `pdl`
    both launch as programmatic dependents (the decode graph's chain, `PDL_OPS`)."""
    tokens = x.shape[0]
    if tokens == 0:
        return
    g = _geometry("lora_gather_add", y, x, a, b_t, widths, None, _K_PER_SPLIT, _MAX_SPLITS)
    part = torch.empty(tokens, g.splits, g.block_tr, dtype=torch.float32, device=x.device)
    _lora_shrink[(tokens, g.splits)](
        x, a, token_slots, part, g.fan_in, g.rank, g.k_per_split, x.stride(0), a.stride(0),
        a.stride(1), a.stride(2),
        T=g.targets, SPLITS=g.splits, BLOCK_R=g.block_r, BLOCK_TR=g.block_tr, BLOCK_K=g.block_k,
        PDL=pdl, **pdl_options(pdl),
    )  # fmt: skip
    block_n = 128
    _lora_expand[(tokens, triton.cdiv(g.fan_out, block_n))](
        part, b_t, token_slots, scales, y, g.fan_out, g.rank, *g.bounds, y.stride(0),
        b_t.stride(0), b_t.stride(1), scales.stride(0),
        T=g.targets, SPLITS=g.splits, SPLITS_P2=triton.next_power_of_2(g.splits),
        BLOCK_R=g.block_r, BLOCK_TR=g.block_tr, BLOCK_N=block_n, PDL=pdl, **pdl_options(pdl),
    )  # fmt: skip


@triton.jit
def _lora_tile_shrink(
    x_ptr, a_ptr, tiles_ptr, part_ptr,
    K, R, k_per_split, stride_x, stride_as, stride_at, stride_ar,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    sp = tl.program_id(1)
    start, s, m, m_mask = _tile_rows(tiles_ptr, tl.program_id(0), BLOCK_M)
    rows_x = x_ptr + (start + m).to(tl.int64) * stride_x
    jr, rows_a, jr_mask = _a_rows(a_ptr, s, R, stride_as, stride_at, stride_ar, T, BLOCK_R,
                                  BLOCK_TR)  # fmt: skip
    acc = tl.zeros((BLOCK_M, BLOCK_TR), dtype=tl.float32)
    k_start = sp * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xv = tl.load(
            rows_x[:, None] + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        av = tl.load(
            rows_a[:, None] + k[None, :], mask=jr_mask[:, None] & k_mask[None, :], other=0.0
        )
        # float32 operands: a bf16/fp16 value is exact in tf32, so tf32 products of them are
        # exact too (and Triton's interpreter, which has no bf16 dot, runs the same code)
        xf, af = xv.to(tl.float32), tl.trans(av.to(tl.float32))
        if IEEE:
            acc += tl.dot(xf, af, input_precision="ieee")
        else:
            acc += tl.dot(xf, af, input_precision="tf32")
    out = part_ptr + ((start + m).to(tl.int64)[:, None] * SPLITS + sp) * BLOCK_TR + jr[None, :]
    tl.store(out, acc, mask=m_mask[:, None])


@triton.jit
def _lora_tile_expand(
    part_ptr, b_ptr, tiles_ptr, scales_ptr, y_ptr,
    N, R, n1, n2, stride_y, stride_bs, stride_br, stride_ss,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    nb = tl.program_id(1)
    start, s, m, m_mask = _tile_rows(tiles_ptr, tl.program_id(0), BLOCK_M)
    tokens = (start + m).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    bv = _b_tile(b_ptr, s, r, r_mask, n, n_mask, stride_bs, stride_br)
    target = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for jj in tl.static_range(T):
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for sp in range(SPLITS):
            xa += tl.load(
                part_ptr + (tokens[:, None] * SPLITS + sp) * BLOCK_TR + jj * BLOCK_R + r[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
        xa = xa * tl.load(scales_ptr + s * stride_ss + jj)
        if IEEE:
            dj = tl.dot(xa, bv.to(tl.float32), input_precision="ieee")
        else:  # xa rounded to the weights' dtype first, as the reference does
            dj = tl.dot(xa.to(bv.dtype).to(tl.float32), bv.to(tl.float32), input_precision="tf32")
        delta = tl.where(target[None, :] == jj, dj, delta)
    ptr = y_ptr + tokens[:, None] * stride_y + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    yv = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (yv + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_tiles_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, tiles: torch.Tensor,
    scales: torch.Tensor, widths: tuple[int, ...],
) -> None:  # fmt: skip
    """`lora_reference.lora_tiles_add` (see there): per tile of at most `lora_reference.LORA_TILE_ROWS` token rows of one
    adapter, a split-K shrink and an expand, each one `tl.dot` per tile, so a prefill chunk
    reads each adapter's A and B once per tile rather than once per token."""
    num_tiles = tiles.shape[0]
    if num_tiles == 0 or x.shape[0] == 0:
        return
    g = _geometry("lora_tiles_add", y, x, a, b_t, widths, 64, 2 * _K_PER_SPLIT, _MAX_SPLITS // 4)
    ieee = x.dtype == torch.float32
    part = torch.empty(x.shape[0], g.splits, g.block_tr, dtype=torch.float32, device=x.device)
    _lora_tile_shrink[(num_tiles, g.splits)](
        x, a, tiles, part, g.fan_in, g.rank, g.k_per_split, x.stride(0), a.stride(0),
        a.stride(1), a.stride(2),
        T=g.targets, SPLITS=g.splits, BLOCK_M=TILE_ROWS, BLOCK_R=g.block_r,
        BLOCK_TR=g.block_tr, BLOCK_K=g.block_k, IEEE=ieee,
    )  # fmt: skip
    block_n = 64
    _lora_tile_expand[(num_tiles, triton.cdiv(g.fan_out, block_n))](
        part, b_t, tiles, scales, y, g.fan_out, g.rank, *g.bounds, y.stride(0),
        b_t.stride(0), b_t.stride(1), scales.stride(0),
        T=g.targets, SPLITS=g.splits, BLOCK_M=TILE_ROWS, BLOCK_R=g.block_r,
        BLOCK_TR=g.block_tr, BLOCK_N=block_n, IEEE=ieee,
    )  # fmt: skip
