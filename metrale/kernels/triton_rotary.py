"""Triton kernel for rotary position embedding of q and k, optionally fused with the per-head
q/k RMSNorm that Qwen3 applies before it, and optionally with the KV-cache write.

Owner: kernels. Computes `reference.rotary_embedding` / `reference.qk_norm_rotary` and their
cache-writing forms `reference.rotary_write_kv` / `reference.qk_norm_rotary_write_kv`;
`tests/gpu/test_kernels.py` checks them against the references and the fused forms
bit-for-bit against this module's rotary followed by `triton_attention.write_kv`.

Invariants:
- `cos_sin` is the layer's table `[max_positions, 2, rotary_dim // 2]` float32 (cos then sin,
  already scaled); rotation uses the rotate-half layout on the first `rotary_dim` dims, the
  remaining dims pass through (normalised when the norm is fused).
- The rotation runs in float32 on values already rounded to the output dtype, and the result
  is rounded once, as the reference does; with the norm, normalised values are rounded to the
  input dtype before the weight multiply (transformers' RMSNorm).
- One program per token handles every q and k head (and, writing the cache, every v head);
  inputs are never written.
- Writing the cache, the rotated k is never materialised: each program stores its k heads,
  rounded to the dtype the unfused op would return and then cast to the cache dtype, and its
  v heads (cast to the cache dtype) straight at `slot_mapping[token]`, with the slot rules of
  `triton_attention.write_kv` (a slot < 0 is skipped; q is still written). So the cache
  holds exactly what rotary + `write_kv` would leave there. A float8 cache gets
  `reference.quantize_kv` of those values with the layer's K / V scale (read on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import (
    _check_cache_pair,
    _quantize_kv,
    kv_scale_args,
    pdl_enter,
    pdl_options,
)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


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
    stride_dh,
    eps,
    kv_scale,
    OUT_TY: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    NORM: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """Rotate (after the norm, with NORM) the heads of one token. `dst_ptr` is the token's
    output row, heads `stride_dh` apart; results are rounded to `OUT_TY` (the op's output
    dtype), then stored in the destination's dtype (the same, or the cache's: with KV_FP8
    quantized by `kv_scale`)."""
    heads = tl.arange(0, BLOCK_HEADS)
    j = tl.arange(0, BLOCK_HALF)
    h_mask = heads < num_heads
    m = h_mask[:, None] & (j < HALF)[None, :]
    src = src_ptr + token.to(tl.int64) * stride_st + heads[:, None] * stride_sh
    dst = dst_ptr + heads[:, None] * stride_dh
    x1 = tl.load(src + j[None, :], mask=m, other=0.0)
    x2 = tl.load(src + HALF + j[None, :], mask=m, other=0.0)
    store_ty = dst_ptr.dtype.element_ty
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
        a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(OUT_TY).to(tl.float32)
        b = ((b * rstd).to(x1.dtype).to(tl.float32) * w2).to(OUT_TY).to(tl.float32)
        if REST > 0:
            w3 = tl.load(w_ptr + 2 * HALF + r, mask=r < REST, other=0.0).to(tl.float32)[None, :]
            c = (c * rstd).to(x1.dtype).to(tl.float32) * w3
    lo = _quantize_kv((a * cos - b * sin).to(OUT_TY).to(tl.float32), kv_scale, KV_FP8, store_ty)
    hi = _quantize_kv((b * cos + a * sin).to(OUT_TY).to(tl.float32), kv_scale, KV_FP8, store_ty)
    tl.store(dst + j[None, :], lo, mask=m)
    tl.store(dst + HALF + j[None, :], hi, mask=m)
    if REST > 0:
        tail = _quantize_kv(c.to(OUT_TY).to(tl.float32), kv_scale, KV_FP8, store_ty)
        tl.store(dst + 2 * HALF + r[None, :], tail, mask=rm)


@triton.jit
def _copy_heads(
    src_ptr,
    dst_ptr,
    token,
    num_heads,
    stride_st,
    stride_sh,
    stride_dh,
    kv_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    """Copy the heads of one token to the row at `dst_ptr` (heads `stride_dh` apart), cast
    to the destination's dtype (with KV_FP8 quantized by `kv_scale`): `write_kv`'s store of
    v."""
    heads = tl.arange(0, BLOCK_HEADS)
    d = tl.arange(0, BLOCK_D)
    m = (heads < num_heads)[:, None] & (d < HEAD_DIM)[None, :]
    src = src_ptr + token.to(tl.int64) * stride_st + heads[:, None] * stride_sh + d[None, :]
    x = tl.load(src, mask=m)
    if KV_FP8:
        x = _quantize_kv(x.to(tl.float32), kv_scale, True, dst_ptr.dtype.element_ty)
    tl.store(
        dst_ptr + heads[:, None] * stride_dh + d[None, :], x.to(dst_ptr.dtype.element_ty), mask=m
    )


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    v_cache_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    slots_ptr,
    cos_sin_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cs_pos,
    stride_cs_kind,
    eps,
    K_TY: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    REST: tl.constexpr,
    BLOCK_REST: tl.constexpr,
    NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
):
    pdl_enter(PDL)  # programmatic dependent launch: see triton_attention_common
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cs = cos_sin_ptr + pos * stride_cs_pos + j
    cos = tl.load(cs, mask=j < HALF, other=0.0)[None, :]
    sin = tl.load(cs + stride_cs_kind, mask=j < HALF, other=0.0)[None, :]
    q_row = q_out_ptr + token.to(tl.int64) * num_q_heads * HEAD_DIM
    _rotate_heads(
        q_ptr, q_row, qw_ptr, cos, sin, token, num_q_heads, stride_qt, stride_qh, HEAD_DIM, eps,
        1.0, q_out_ptr.dtype.element_ty, HEAD_DIM, HALF, BLOCK_Q_HEADS, BLOCK_HALF, REST,
        BLOCK_REST, NORM,
    )  # fmt: skip
    if WRITE_KV:
        # k_out_ptr is the K cache: the rotated k goes straight to the token's slot.
        slot = tl.load(slots_ptr + token).to(tl.int64)
        if slot >= 0:
            row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            k_scale = 1.0
            v_scale = 1.0
            if KV_FP8:
                k_scale = tl.load(k_scale_ptr)
                v_scale = tl.load(v_scale_ptr)
            _rotate_heads(
                k_ptr, k_out_ptr + row, kw_ptr, cos, sin, token, num_k_heads, stride_kt,
                stride_kh, stride_ch, eps, k_scale,
                K_TY, HEAD_DIM, HALF, BLOCK_K_HEADS, BLOCK_HALF, REST, BLOCK_REST, NORM, KV_FP8,
            )  # fmt: skip
            _copy_heads(
                v_ptr, v_cache_ptr + row, token, num_k_heads, stride_vt, stride_vh, stride_ch,
                v_scale, HEAD_DIM, BLOCK_K_HEADS, BLOCK_D, KV_FP8,
            )  # fmt: skip
    else:
        k_row = k_out_ptr + token.to(tl.int64) * num_k_heads * HEAD_DIM
        _rotate_heads(
            k_ptr, k_row, kw_ptr, cos, sin, token, num_k_heads, stride_kt, stride_kh, HEAD_DIM,
            eps, 1.0,
            K_TY, HEAD_DIM, HALF, BLOCK_K_HEADS, BLOCK_HALF, REST, BLOCK_REST, NORM,
        )  # fmt: skip


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    weights: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q and k; without `cache` return `(q_out, k_out)`, with `cache` =
    `(v, k_cache, v_cache, slot_mapping)` write rotated k and v there (quantized with
    `scales` = `(k_scale, v_scale)` for a float8 cache) and return `(q_out, None)`."""
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
    if cache is None:
        k_out: torch.Tensor | None = torch.empty(k.shape, dtype=k_dtype, device=k.device)
        v = k_dst = v_dst = k  # v, v_dst unused; k_dst is k_out
        slots = positions  # unused
        cache_strides, block_size = (0, 0, 0), 1
        k_scale, v_scale, fp8 = cos_sin, cos_sin, False  # unused
    else:
        v, k_dst, v_dst, slots = cache
        _check_cache_pair(k_dst, v_dst)
        k_scale, v_scale, fp8 = kv_scale_args(k_dst, *scales)
        if k_dst.shape[2:] != (k_heads, head_dim) or v.shape != k.shape:
            raise ValueError(
                f"k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the caches {tuple(k_dst.shape)}"
            )
        if v.stride(-1) != 1:
            v = v.contiguous()
        k_out = None
        cache_strides, block_size = k_dst.stride()[:3], k_dst.shape[1]
    if tokens == 0:
        return q_out, k_out
    if k_out is not None:
        k_dst = k_out
    half = rotary_dim // 2
    rest = head_dim - rotary_dim
    block_heads = triton.next_power_of_2(max(q_heads, k_heads))
    _rotary_kernel[(tokens,)](
        q,
        k,
        v,
        q_out,
        k_dst,
        v_dst,
        qw,
        kw,
        positions,
        slots,
        cos_sin,
        k_scale,
        v_scale,
        q_heads,
        k_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *cache_strides,
        cos_sin.stride(0),
        cos_sin.stride(1),
        eps,
        K_TY=_TL_DTYPES[k_dtype],
        HEAD_DIM=head_dim,
        HALF=half,
        BLOCK_Q_HEADS=triton.next_power_of_2(q_heads),
        BLOCK_K_HEADS=triton.next_power_of_2(k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_D=triton.next_power_of_2(head_dim),
        REST=rest,
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
        NORM=weights is not None,
        WRITE_KV=cache is not None,
        BLOCK_SIZE=block_size,
        PDL=pdl,
        KV_FP8=fp8,
        num_warps=max(1, min(8, block_heads * head_dim // 512)),
        **pdl_options(pdl),
    )
    return q_out, k_out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` by `positions` `[T]`; same as
    `reference.rotary_embedding`."""
    q_out, k_out = _launch(positions, q, k, cos_sin, rotary_dim, None, 0.0)
    assert k_out is not None
    return q_out, k_out


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, eps: float, cos_sin: torch.Tensor, rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per-head RMSNorm of q and k (weights `[D]`), then rotary; one launch. Same as
    `reference.qk_norm_rotary`."""
    q_out, k_out = _launch(positions, q, k, cos_sin, rotary_dim, (q_weight, k_weight), eps)
    assert k_out is not None
    return q_out, k_out


def rotary_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cos_sin: torch.Tensor, rotary_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, *, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`rotary_embedding`, then `write_kv` of the rotated k and of v `[T, Hk, D]` into the
    `[NB, BS, Hk, D]` caches, in one launch; returns the rotated q. Same as
    `reference.rotary_write_kv`; slots < 0 are skipped, as `triton_attention.write_kv` does."""
    cache = (v, k_cache, v_cache, slot_mapping)
    return _launch(positions, q, k, cos_sin, rotary_dim, None, 0.0, cache, pdl, (k_scale, v_scale))[
        0
    ]


def qk_norm_rotary_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos_sin: torch.Tensor,
    rotary_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`qk_norm_rotary`, then `write_kv` of the rotated k and of v, in one launch; returns the
    rotated q. Same as `reference.qk_norm_rotary_write_kv`; slots < 0 are skipped."""
    cache = (v, k_cache, v_cache, slot_mapping)
    weights = (q_weight, k_weight)
    return _launch(
        positions, q, k, cos_sin, rotary_dim, weights, eps, cache, pdl, (k_scale, v_scale)
    )[0]
