"""Triton kernel for rotary position embedding of q and k, optionally fused with the per-head
q/k RMSNorm that Qwen3 applies before it.

Owner: kernels. Computes `reference.rotary_embedding` / `reference.qk_norm_rotary`;
`tests/gpu/test_kernels.py` checks it against them.

Invariants:
- `cos_sin` is the layer's table `[max_positions, 2, rotary_dim // 2]` float32 (cos then sin,
  already scaled); rotation uses the rotate-half layout on the first `rotary_dim` dims, the
  remaining dims pass through (normalised when the norm is fused).
- The rotation runs in float32 on values already rounded to the output dtype, and the result
  is rounded once, as the reference does; with the norm, normalised values are rounded to the
  input dtype before the weight multiply (transformers' RMSNorm).
- One program per token handles every q and k head; inputs are never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    w_ptr,
    cos,
    sin,
    token,
    num_heads,
    stride_st,
    stride_sh,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    NORM: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_HEADS)
    j = tl.arange(0, BLOCK_HALF)
    h_mask = heads < num_heads
    m = h_mask[:, None] & (j < HALF)[None, :]
    src = src_ptr + token.to(tl.int64) * stride_st + heads[:, None] * stride_sh
    dst = dst_ptr + (token.to(tl.int64) * num_heads + heads[:, None]) * HEAD_DIM
    x1 = tl.load(src + j[None, :], mask=m, other=0.0)
    x2 = tl.load(src + HALF + j[None, :], mask=m, other=0.0)
    out_ty = dst_ptr.dtype.element_ty
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if REST > 0:
        r = tl.arange(0, BLOCK_REST)
        rm = h_mask[:, None] & (r < REST)[None, :]
        x3 = tl.load(src + 2 * HALF + r[None, :], mask=rm, other=0.0)
        c = x3.to(tl.float32)
    if NORM:
        sq = tl.sum(a * a, 1) + tl.sum(b * b, 1)
        if REST > 0:
            sq += tl.sum(c * c, 1)
        rstd = tl.rsqrt(sq / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(out_ty).to(tl.float32)
        b = ((b * rstd).to(x1.dtype).to(tl.float32) * w2).to(out_ty).to(tl.float32)
        if REST > 0:
            w3 = tl.load(w_ptr + 2 * HALF + r, mask=r < REST, other=0.0).to(tl.float32)[None, :]
            c = (c * rstd).to(x1.dtype).to(tl.float32) * w3
    tl.store(dst + j[None, :], (a * cos - b * sin).to(out_ty), mask=m)
    tl.store(dst + HALF + j[None, :], (b * cos + a * sin).to(out_ty), mask=m)
    if REST > 0:
        tl.store(dst + 2 * HALF + r[None, :], c.to(out_ty), mask=rm)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs_pos,
    stride_cs_kind,
    eps,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    NORM: tl.constexpr,
):
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cs = cos_sin_ptr + pos * stride_cs_pos + j
    cos = tl.load(cs, mask=j < HALF, other=0.0)[None, :]
    sin = tl.load(cs + stride_cs_kind, mask=j < HALF, other=0.0)[None, :]
    _rotate_heads(
        q_ptr, q_out_ptr, qw_ptr, cos, sin, token, num_q_heads, stride_qt, stride_qh, eps,
        HEAD_DIM, HALF, BLOCK_Q_HEADS, BLOCK_HALF, REST, BLOCK_REST, NORM,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, kw_ptr, cos, sin, token, num_k_heads, stride_kt, stride_kh, eps,
        HEAD_DIM, HALF, BLOCK_K_HEADS, BLOCK_HALF, REST, BLOCK_REST, NORM,
    )  # fmt: skip


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    weights: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if rotary_dim % 2 or rotary_dim > head_dim or rotary_dim <= 0:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
    if cos_sin.dtype != torch.float32 or cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.float().contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if weights is None:
        q_dtype, k_dtype = q.dtype, k.dtype
        qw = kw = cos_sin  # unused
    else:
        qw, kw = weights
        q_dtype = torch.promote_types(q.dtype, qw.dtype)
        k_dtype = torch.promote_types(k.dtype, kw.dtype)
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k_dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    rest = head_dim - rotary_dim
    block_heads = triton.next_power_of_2(max(q_heads, k_heads))
    _rotary_kernel[(tokens,)](
        q,
        k,
        q_out,
        k_out,
        qw,
        kw,
        positions,
        cos_sin,
        q_heads,
        k_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin.stride(0),
        cos_sin.stride(1),
        eps,
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_Q_HEADS=triton.next_power_of_2(q_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        REST=rest,
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        NORM=weights is not None,
        num_warps=max(1, min(8, block_heads * head_dim // 512)),
    )
    return q_out, k_out


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` by `positions` `[T]`; same as
    `reference.rotary_embedding`."""
    return _launch(positions, q, k, cos_sin, rotary_dim, None, 0.0)


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (weights `[D]`), then rotary; one launch. Same as
    `reference.qk_norm_rotary`."""
    return _launch(positions, q, k, cos_sin, rotary_dim, (q_weight, k_weight), eps)
