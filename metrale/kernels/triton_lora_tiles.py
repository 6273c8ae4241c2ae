"""Multi-LoRA on CUDA for many rows: the tiled form of `lora_reference.lora_tiles_add` (each
tile of token rows of one adapter reads that adapter's A and B once, a split-K shrink and an
expand, one `tl.dot` per tile) and `lora_plan`, which groups a decode graph's rows by slot on
the device (one program, no host read) so the tiled form can serve it, SGMV-like. The
per-row gather forms are in `triton_lora`, whose launch geometry these kernels share.

Owner: kernels. `lora_tiles_add` and `lora_plan` are the CUDA entries of the `KernelOps` ops
of the same names.

Invariants:
- Each op computes its reference (`lora_reference`): rows in no tile are neither read nor
  written, the rank dimension is padded to a power of two and masked, accumulation is
  float32; an empty tile (count 0) reads and writes nothing.
- No host read of the slot tensor or of the plan: every launch depends only on shapes, so the
  ops can be captured in a CUDA graph with the slot tensor as a graph input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.lora_reference import LORA_PLAN_ROWS as PLAN_ROWS
from metrale.kernels.lora_reference import LORA_TILE_ROWS as TILE_ROWS
from metrale.kernels.lora_reference import lora_plan_max_tiles
from metrale.kernels.triton_attention_common import pdl_enter, pdl_options
from metrale.kernels.triton_lora import _K_PER_SPLIT, _MAX_SPLITS, _geometry


@triton.jit
def _lora_tile_rows(order_ptr, start, count, BLOCK_M: tl.constexpr, ORDERED: tl.constexpr):
    """A tile's token rows (int64) and their mask: `order[start + m]` or `start + m`."""
    m = tl.arange(0, BLOCK_M)
    m_mask = m < count
    if ORDERED:
        rows = tl.load(order_ptr + start + m, mask=m_mask, other=0).to(tl.int64)
    else:
        rows = (start + m).to(tl.int64)
    return rows, m_mask


@triton.jit
def _lora_tile_shrink(
    x_ptr, a_ptr, tiles_ptr, order_ptr, part_ptr,
    K, R, k_per_split, stride_x, stride_as, stride_at, stride_ar,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    tile = tl.program_id(0)
    sp = tl.program_id(1)
    start = tl.load(tiles_ptr + tile * 3)
    count = tl.load(tiles_ptr + tile * 3 + 1)
    s = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    rows, m_mask = _lora_tile_rows(order_ptr, start, count, BLOCK_M, ORDERED)
    rows_x = x_ptr + rows * stride_x
    jr = tl.arange(0, BLOCK_TR)
    j = jr // BLOCK_R
    r = jr % BLOCK_R
    jr_mask = (j < T) & (r < R) & ((jr * 0 + count) > 0)  # an empty tile reads nothing
    rows_a = a_ptr + s * stride_as + j.to(tl.int64) * stride_at + r.to(tl.int64) * stride_ar
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
    out = part_ptr + (rows[:, None] * SPLITS + sp) * BLOCK_TR + jr[None, :]
    tl.store(out, acc, mask=m_mask[:, None])


@triton.jit
def _lora_tile_expand(
    part_ptr, b_ptr, tiles_ptr, order_ptr, scales_ptr, y_ptr,
    N, R, n1, n2, stride_y, stride_bs, stride_br, stride_ss,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(tiles_ptr + tile * 3)
    count = tl.load(tiles_ptr + tile * 3 + 1)
    s = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    tokens, m_mask = _lora_tile_rows(order_ptr, start, count, BLOCK_M, ORDERED)
    r = tl.arange(0, BLOCK_R)
    r_mask = (r < R) & ((r * 0 + count) > 0)  # an empty tile reads nothing
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    bv = tl.load(
        b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
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
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
    order: torch.Tensor | None = None,
    pdl: bool = False,
) -> None:
    """`lora_reference.lora_tiles_add` (see there): per tile of token rows of one adapter (at
    most `LORA_TILE_ROWS` of them, or `LORA_PLAN_ROWS` through `order`), a split-K shrink and
    an expand, each one `tl.dot` per tile, so the tile reads its adapter's A and B once rather
    than once per token. Empty tiles (count 0) read and write nothing. The launch depends only
    on the shapes (capturable with `lora_plan`'s outputs as inputs). With `pdl` both kernels
    launch as programmatic dependents (`PDL_OPS`)."""
    num_tiles = tiles.shape[0]
    if num_tiles == 0 or x.shape[0] == 0:
        return
    g = _geometry("lora_tiles_add", y, x, a, b_t, widths, 64, 2 * _K_PER_SPLIT, _MAX_SPLITS // 4)
    ieee = x.dtype == torch.float32
    ordered = order is not None
    block_m = PLAN_ROWS if ordered else TILE_ROWS
    part = torch.empty(x.shape[0], g.splits, g.block_tr, dtype=torch.float32, device=x.device)
    _lora_tile_shrink[(num_tiles, g.splits)](
        x, a, tiles, order if ordered else tiles, part, g.fan_in, g.rank, g.k_per_split,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        T=g.targets, SPLITS=g.splits, BLOCK_M=block_m, BLOCK_R=g.block_r,
        BLOCK_TR=g.block_tr, BLOCK_K=g.block_k, IEEE=ieee, ORDERED=ordered, PDL=pdl,
        **pdl_options(pdl),
    )  # fmt: skip
    block_n = 64
    _lora_tile_expand[(num_tiles, triton.cdiv(g.fan_out, block_n))](
        part, b_t, tiles, order if ordered else tiles, scales, y, g.fan_out, g.rank, *g.bounds,
        y.stride(0), b_t.stride(0), b_t.stride(1), scales.stride(0),
        T=g.targets, SPLITS=g.splits, BLOCK_M=block_m, BLOCK_R=g.block_r,
        BLOCK_TR=g.block_tr, BLOCK_N=block_n, IEEE=ieee, ORDERED=ordered, PDL=pdl,
        **pdl_options(pdl),
    )  # fmt: skip


@triton.jit
def _lora_plan(
    slots_ptr, order_ptr, tiles_ptr, T, max_tiles,
    NUM_SLOTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_TILES: tl.constexpr,
):  # fmt: skip
    """One program: a counting sort of the rows by slot (bucket NUM_SLOTS: the base rows),
    then the tile table (see `lora_reference.lora_plan`)."""
    b = tl.arange(0, BLOCK_S)
    counts = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        sv = tl.load(slots_ptr + t, mask=t < T, other=0).to(tl.int32)
        bucket = tl.where(t < T, tl.where(sv < 0, NUM_SLOTS, sv), BLOCK_S)  # past T: none
        counts += tl.sum((bucket[:, None] == b[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    seen = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        sv = tl.load(slots_ptr + t, mask=t < T, other=0).to(tl.int32)
        bucket = tl.where(t < T, tl.where(sv < 0, NUM_SLOTS, sv), BLOCK_S)
        hot = (bucket[:, None] == b[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot  # earlier rows of the same bucket in this chunk
        pos = tl.sum(hot * ((starts + seen)[None, :] + before), axis=1)
        tl.store(order_ptr + pos, t, mask=t < T)
        seen += tl.sum(hot, axis=0)
    ntiles = tl.where(b < NUM_SLOTS, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tstart = tl.cumsum(ntiles, axis=0) - ntiles
    i = tl.arange(0, BLOCK_TILES)
    hit = ((i[:, None] >= tstart[None, :]) & (i[:, None] < (tstart + ntiles)[None, :])).to(tl.int32)
    has = tl.sum(hit, axis=1) > 0
    j = i - tl.sum(hit * tstart[None, :], axis=1)
    first = tl.sum(hit * starts[None, :], axis=1) + j * BLOCK_M
    count = tl.minimum(tl.sum(hit * counts[None, :], axis=1) - j * BLOCK_M, BLOCK_M)
    slot = tl.sum(hit * b[None, :], axis=1)
    live = i < max_tiles
    tl.store(tiles_ptr + i * 3, tl.where(has, first, 0), mask=live)
    tl.store(tiles_ptr + i * 3 + 1, tl.where(has, count, 0), mask=live)
    tl.store(tiles_ptr + i * 3 + 2, tl.where(has, slot, 0), mask=live)


def lora_plan(
    token_slots: torch.Tensor, num_slots: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_reference.lora_plan` (see there) in one single-program launch: no host read, the
    outputs' sizes fixed by the shapes, so a decode graph captures it with the slot tensor as
    its input. Slots must lie in `[-1, num_slots)` (not checked on the device)."""
    tokens = token_slots.shape[0]
    max_tiles = lora_plan_max_tiles(tokens, num_slots, block_m)
    order = torch.empty(tokens, dtype=torch.int32, device=token_slots.device)
    tiles = torch.empty(max_tiles, 3, dtype=torch.int32, device=token_slots.device)
    if tokens == 0:
        return order, tiles
    _lora_plan[(1,)](
        token_slots, order, tiles, tokens, max_tiles,
        NUM_SLOTS=num_slots, BLOCK_S=triton.next_power_of_2(num_slots + 1),
        BLOCK_T=min(128, triton.next_power_of_2(tokens)), BLOCK_M=block_m,
        BLOCK_TILES=triton.next_power_of_2(max_tiles),
    )  # fmt: skip
    return order, tiles
