"""Triton kernels for the row-wise elementwise ops: RMSNorm, fused residual-add + RMSNorm, and
SiLU-and-multiply.

Owner: kernels. Each computes the function of its torch reference in `reference.py`;
`tests/gpu/test_kernels.py` checks them against it.

Invariants:
- RMSNorm normalises in float32 and rounds to the input dtype BEFORE the weight multiply (as
  transformers does); the result has `torch.promote_types(x.dtype, weight.dtype)`.
- `add_rms_norm` rounds the sum to the residual's dtype first and normalises that rounded sum,
  so its two outputs are exactly what the reference's two steps give (up to the order of the
  float32 sum of squares).
- Inputs are never written; outputs are new contiguous tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import pdl_enter, pdl_options


def _row_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """`(x', inner_rows, stride_outer, stride_inner)` addressing every row of the last dim of
    `x` as row `i` = (i // inner_rows, i % inner_rows), without copying 2-D/3-D views."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, x.shape[0], 0
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1])
    return x, 1, x.stride(0), 0


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 512))


@triton.jit
def _store_rms_norm(out_ptr, row, h, dtype, w_ptr, cols, mask, eps, N: tl.constexpr):
    """Store `weight * rms_norm(h)` at row `row` of the `[rows, N]` output: `h` the row in
    float32, normalised and rounded to `dtype` (the input's) before the weight, as transformers
    does."""
    rstd = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    normed = (h * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    inner_rows,
    stride_xo,
    stride_xi,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0)
    x_off = (row // inner_rows).to(tl.int64) * stride_xo + (row % inner_rows).to(
        tl.int64
    ) * stride_xi
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + x_off + cols, mask=mask, other=0.0)
    _store_rms_norm(out_ptr, row.to(tl.int64), x.to(tl.float32), x.dtype, w_ptr, cols, mask, eps, N)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (any leading shape); same as `reference.rms_norm`.
    `pdl`: launch as a programmatic dependent of the previous kernel (sm_90+)."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out
    xv, inner, s_outer, s_inner = _row_view(x)
    _launch_rows(_rms_norm_kernel, rows, n, pdl, xv, weight, out, inner, s_outer, s_inner, eps)
    return out


def _launch_rows(kernel: Any, rows: int, n: int, pdl: bool, *args: Any) -> None:
    """Launch a norm kernel, one program per row of `n` columns (one block of the next power
    of two, `_norm_warps` warps), as a programmatic dependent with `pdl`."""
    block = triton.next_power_of_2(n)
    kernel[(rows,)](
        *args, N=n, BLOCK=block, PDL=pdl, num_warps=_norm_warps(block), **pdl_options(pdl)
    )


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_r,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    summed = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * N + cols, summed, mask=mask)
    h = summed.to(tl.float32)
    _store_rms_norm(out_ptr, row, h, summed.dtype, w_ptr, cols, mask, eps, N)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual' = residual + x`; returns `(rms_norm(residual'), residual')` in one pass."""
    n = x.shape[-1]
    sum_dtype = torch.promote_types(x.dtype, residual.dtype)
    summed = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    rows = x.numel() // n if n else 0
    if rows == 0:
        return out, summed
    x2 = x.reshape(rows, n)
    r2 = residual.reshape(rows, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    _launch_rows(_add_rms_norm_kernel, rows, n, pdl, x2, r2, weight, out, summed, x2.stride(0),
                 r2.stride(0), eps)  # fmt: skip
    return out, summed


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(
        out_ptr + row * N + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of `[..., 2I]` -> `[..., I]`; same as `reference.silu_and_mul`."""
    n = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    rows = out.numel() // n if n else 0
    if rows == 0:
        return out
    x2 = gate_up.reshape(rows, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block = min(2048, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](
        x2, out, x2.stride(0), N=n, BLOCK=block, num_warps=max(1, min(8, block // 256))
    )
    return out
