"""Multi-LoRA's "epilogue" form on CUDA: the expand folded into the base projection's GEMV.
A group of targets (q/k/v, o, gate/up, down) at few rows costs two launches instead of three:
the shrink (`lora_shrink`: `x @ A[slot, j].T` per target j, float32 partial sums per K split;
or of `silu(gate) * up` for the down projection, `act=True`), launched before the base GEMV
since it needs only x, then `triton_gemv.gemv` / `gemv_silu_mul` with a `LoraEpilogue`: each
output column it stores gets `scale_j * xa_j @ B[slot, :, col]` of its row's slot, where
`xa_j` is the sum of the partials (the split-K reduce kernel does the same when the GEMV
splits K).

Owner: kernels. `triton_linear.lora_linear` (the CUDA entry of `KernelOps.lora_linear`)
launches the pair; `triton_gemv` calls `lora_load_bs` / `lora_store_rows` (and, in its
split-K reduce, `lora_load_b` / `lora_add_delta`) from its kernels under its `LORA`
constexpr switch, so the plain GEMV compiles as before (its SASS checked identical).

Invariants:
- The numerics of the split form (`triton_lora.lora_gather_add(form="split")`): the same
  shrink partials, summed in split order, times the target's scale, then `@ B` in float32;
  the base output is rounded to its dtype first (bias included), then the delta is added and
  the sum rounded again (peft's order: base, then delta, in the output dtype).
- Rows of slot -1 read no adapter weights and store exactly the plain GEMV's values.
- With `act`, the shrink's input is the activation `gemv_silu_mul` feeds its dot (SiLU and
  the multiply each rounded to the input dtype), so the down projection's delta reads what
  `reference.silu_and_mul` would materialise.
- No host read of the slot tensor: launches depend only on shapes (CUDA-graph capturable).
  With PDL the shrink loads its first A tile, and the GEMV each row's B tile (and slot),
  before waiting for the previous kernel, which must not write A, B or the slots (in a
  decode graph none does); the partials and scales are read after the wait.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import pdl_options
from metrale.kernels.triton_lora import (
    _K_PER_SPLIT,
    _MAX_SPLITS,
    _Geometry,
    _geometry,
    _lora_shrink,
)


class LoraEpilogue(NamedTuple):
    """What a GEMV needs to add each row's LoRA delta to the columns it stores: the shrink's
    float32 partials `[rows, splits, block_tr]`, the group's `b_t [slots, R, N]`, the per-row
    slots (`[rows]`, -1: no delta), the scales `[slots, T]` and the group's geometry."""

    part: torch.Tensor
    b_t: torch.Tensor
    token_slots: torch.Tensor
    scales: torch.Tensor
    geometry: _Geometry


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, token_slots: torch.Tensor,
    scales: torch.Tensor, widths: tuple[int, ...], *, act: bool = False, pdl: bool = False,
) -> LoraEpilogue:  # fmt: skip
    """The first launch of the epilogue form: the shrink partials of every row of `x` (with
    `act`, of `silu_and_mul(x)`: x is then a gate/up row `[rows, 2 * in]`), returned with
    what the GEMV's epilogue reads. `a [slots, T, R, in]`, `b_t [slots, R, sum(widths)]`."""
    if x.dim() != 2 or x.shape[0] != token_slots.shape[0]:
        raise ValueError(
            f"lora_shrink: x {tuple(x.shape)} and token_slots {tuple(token_slots.shape)} "
            "must give one slot per row"
        )
    fan_in = a.shape[3]
    if x.shape[1] != (2 if act else 1) * fan_in:
        raise ValueError(
            f"lora_shrink: x has {x.shape[1]} features, A takes {fan_in}"
            + (" (act: x is gate then up)" if act else "")
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    y_like = b_t[0]  # `_geometry` reads the output width and its row stride from a 2-D y
    g = _geometry("lora_shrink", y_like, x, a, b_t, widths, None, _K_PER_SPLIT, _MAX_SPLITS)
    part = torch.empty(x.shape[0], g.splits, g.block_tr, dtype=torch.float32, device=x.device)
    _lora_shrink[(x.shape[0], g.splits)](
        x, a, token_slots, part, g.fan_in, g.rank, g.k_per_split, fan_in, x.stride(0),
        a.stride(0), a.stride(1), a.stride(2),
        T=g.targets, SPLITS=g.splits, BLOCK_R=g.block_r, BLOCK_TR=g.block_tr, BLOCK_K=g.block_k,
        ACT=act, PDL=pdl, **pdl_options(pdl),
    )  # fmt: skip
    return LoraEpilogue(part, b_t, token_slots, scales, g)


@triton.jit
def lora_load_b(lb_ptr, slots_ptr, row, offs_n, n_mask, R, stride_bs, stride_br,
                BLOCK_R: tl.constexpr):  # fmt: skip
    """The `[BLOCK_R, len(offs_n)]` tile of B (its dtype) that token row `row`'s slot adds
    through at columns `offs_n`: zeros past the rank, and for a base row (none read). Reads
    only B and the slot tensor, which no kernel of the chain writes: a GEMV loads it before
    its PDL wait, so the latency hides behind the previous kernel and the W stream."""
    slot = tl.load(slots_ptr + row)
    s = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = (r < R) & ((r * 0 + slot) >= 0)  # base rows read no B
    return tl.load(
        lb_ptr + s * stride_bs + r[:, None] * stride_br + offs_n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )


@triton.jit
def lora_load_bs(lb_ptr, slots_ptr, offs_n, n_mask, R, stride_bs, stride_br, M: tl.constexpr,
                 BLOCK_R: tl.constexpr):  # fmt: skip
    """`lora_load_b` of each of the M rows (rows past M: row 0's tile, never used)."""
    b0 = lora_load_b(lb_ptr, slots_ptr, 0, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    b1, b2, b3, b4, b5, b6, b7 = b0, b0, b0, b0, b0, b0, b0
    if M > 1:
        b1 = lora_load_b(lb_ptr, slots_ptr, 1, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    if M > 2:
        b2 = lora_load_b(lb_ptr, slots_ptr, 2, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    if M > 3:
        b3 = lora_load_b(lb_ptr, slots_ptr, 3, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    if M > 4:
        b4 = lora_load_b(lb_ptr, slots_ptr, 4, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    if M > 5:
        b5 = lora_load_b(lb_ptr, slots_ptr, 5, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    if M > 6:
        b6 = lora_load_b(lb_ptr, slots_ptr, 6, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    if M > 7:
        b7 = lora_load_b(lb_ptr, slots_ptr, 7, offs_n, n_mask, R, stride_bs, stride_br, BLOCK_R)
    return b0, b1, b2, b3, b4, b5, b6, b7


@triton.jit
def lora_add_delta(
    y, out_ty: tl.constexpr, bv, part_ptr, slots_ptr, scales_ptr, row, offs_n, R, n1, n2,
    stride_ss, T: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`y` (float32, bias included) rounded to `out_ty`, plus token row `row`'s LoRA delta
    at columns `offs_n` (B tile `bv` from `lora_load_b`), rounded again; a base row's `y`
    rounded once (the plain GEMV's value). The delta is `triton_lora._lora_expand`'s: the
    shrink's partials summed in split order, scaled per target, then `@ B` in float32. The
    partials are the previous kernel's: read only after the PDL wait."""
    base = y.to(out_ty)
    slot = tl.load(slots_ptr + row)
    s = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = (r < R) & ((r * 0 + slot) >= 0)  # base rows read no partials
    b = bv.to(tl.float32)
    target = (offs_n >= n1).to(tl.int32) + (offs_n >= n2).to(tl.int32)  # which target owns n
    sp = tl.arange(0, SPLITS_P2)
    parts = part_ptr + (row * SPLITS + sp[:, None]) * BLOCK_TR + r[None, :]
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for jj in tl.static_range(T):
        p = tl.load(parts + jj * BLOCK_R, mask=(sp[:, None] < SPLITS) & r_mask[None, :], other=0.0)
        xa = tl.sum(p, axis=0) * tl.load(scales_ptr + s * stride_ss + jj)
        delta = tl.where(target == jj, tl.sum(b * xa[:, None], axis=0), delta)
    return tl.where(slot >= 0, (base.to(tl.float32) + delta).to(out_ty), base)


@triton.jit
def _lora_store_row(
    out_ptr, b_ptr, acc, bv, row, offs_n, n_mask, stride_om, part_ptr, slots_ptr, scales_ptr,
    R, n1, n2, stride_ss, HAS_BIAS: tl.constexpr, T: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`triton_gemv_tiles._store_row` (unsplit) with row `row`'s LoRA delta added."""
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = lora_add_delta(
        y, out_ptr.dtype.element_ty, bv, part_ptr, slots_ptr, scales_ptr, row, offs_n, R, n1,
        n2, stride_ss, T, SPLITS, SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_om + offs_n, out, mask=n_mask)


@triton.jit
def lora_store_rows(
    out_ptr, b_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, bv0, bv1, bv2, bv3, bv4,
    bv5, bv6, bv7, offs_n, n_mask, stride_om, part_ptr, slots_ptr, scales_ptr, R, n1, n2,
    stride_ss, M: tl.constexpr, HAS_BIAS: tl.constexpr, T: tl.constexpr, SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`triton_gemv_tiles._store_rows` (unsplit, no row scales) with each row's LoRA delta (B
    tiles `bv0..` from `lora_load_bs`)."""
    _lora_store_row(out_ptr, b_ptr, acc0, bv0, 0, offs_n, n_mask, stride_om, part_ptr,
                    slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS, SPLITS_P2,
                    BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip
    if M > 1:
        _lora_store_row(out_ptr, b_ptr, acc1, bv1, 1, offs_n, n_mask, stride_om, part_ptr,
                        slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS,
                        SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip
    if M > 2:
        _lora_store_row(out_ptr, b_ptr, acc2, bv2, 2, offs_n, n_mask, stride_om, part_ptr,
                        slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS,
                        SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip
    if M > 3:
        _lora_store_row(out_ptr, b_ptr, acc3, bv3, 3, offs_n, n_mask, stride_om, part_ptr,
                        slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS,
                        SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip
    if M > 4:
        _lora_store_row(out_ptr, b_ptr, acc4, bv4, 4, offs_n, n_mask, stride_om, part_ptr,
                        slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS,
                        SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip
    if M > 5:
        _lora_store_row(out_ptr, b_ptr, acc5, bv5, 5, offs_n, n_mask, stride_om, part_ptr,
                        slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS,
                        SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip
    if M > 6:
        _lora_store_row(out_ptr, b_ptr, acc6, bv6, 6, offs_n, n_mask, stride_om, part_ptr,
                        slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS,
                        SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip
    if M > 7:
        _lora_store_row(out_ptr, b_ptr, acc7, bv7, 7, offs_n, n_mask, stride_om, part_ptr,
                        slots_ptr, scales_ptr, R, n1, n2, stride_ss, HAS_BIAS, T, SPLITS,
                        SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N)  # fmt: skip


def epilogue_args(lora: LoraEpilogue | None, m: int, n: int, dummy: torch.Tensor) -> dict:
    """The LoRA arguments of a GEMV launch (`triton_gemv._launch`): checked against the
    projection's `m` rows and `n` columns; placeholders (never read) without an epilogue."""
    if lora is None:
        return {
            "part_ptr": dummy, "lb_ptr": dummy, "slots_ptr": dummy, "scales_ptr": dummy,
            "R": 0, "n1": 0, "n2": 0, "stride_bs": 0, "stride_br": 0, "stride_ss": 0,
            "LORA": False, "T": 1, "SPLITS": 1, "SPLITS_P2": 1, "BLOCK_R": 16, "BLOCK_TR": 16,
        }  # fmt: skip
    g = lora.geometry
    if lora.part.shape != (m, g.splits, g.block_tr) or lora.token_slots.shape[0] != m:
        raise ValueError(
            f"gemv: LoRA partials {tuple(lora.part.shape)} / slots "
            f"{tuple(lora.token_slots.shape)} do not match {m} rows"
        )
    if g.fan_out != n or lora.b_t.shape[2] != n or lora.b_t.stride(2) != 1:
        raise ValueError(f"gemv: the LoRA group's {g.fan_out} columns are not the output's {n}")
    return {
        "part_ptr": lora.part, "lb_ptr": lora.b_t, "slots_ptr": lora.token_slots,
        "scales_ptr": lora.scales, "R": g.rank, "n1": g.bounds[0], "n2": g.bounds[1],
        "stride_bs": lora.b_t.stride(0), "stride_br": lora.b_t.stride(1),
        "stride_ss": lora.scales.stride(0), "LORA": True, "T": g.targets, "SPLITS": g.splits,
        "SPLITS_P2": triton.next_power_of_2(g.splits), "BLOCK_R": g.block_r,
        "BLOCK_TR": g.block_tr,
    }  # fmt: skip
