"""Torch reference implementations of the hot ops. They define what every Triton kernel must
compute, and they are the CPU path. The sampler's references are in `sampling_reference`
(re-exported here).

Owner: kernels.

Invariants:
- Float32 in, float32 out reproduces transformers' Llama-family math to rounding: RMSNorm
  normalises in float32 and casts back before the weight multiply, attention softmax runs in
  the input dtype through `scaled_dot_product_attention`.
- `paged_attention` reads K/V only through `block_tables`: a chunk that starts after a cached
  prefix and a decode row are the same computation; so are the Q decode rows of a sequence
  (`meta.decode_query_len` = Q, a speculative verify step) and a Q-token chunk.
- A float8 KV cache (`torch.float8_e4m3fn`) holds `quantize_kv(x, scale)`: `x / scale` in
  float32, saturated to +-448, cast with round-to-nearest-even; a reader takes
  `dequantize_kv` = float8 value x scale (in float32, then the query dtype) and the attention
  math after it is unchanged. Every KV writer and reader takes `k_scale` / `v_scale` (`[1]`
  float32 tensors); they are required with a float8 cache and ignored otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels.metadata import AttentionMetadata

# The sampler's references live in `sampling_reference`; re-exported, so every hot op's
# reference is named `reference.<op>`.
from metrale.kernels.sampling_reference import (  # noqa: F401
    apply_token_bitmask,
    argmax,
    candidate_sample,
    greedy_logprobs,
    masked_argmax,
    row_topk,
    stop_masked_greedy,
    token_logprobs,
    top_k_top_p_filter,
    top_k_top_p_sample,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual' = residual + x`; returns `(rms_norm(residual'), residual')`."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` (torch's `Linear`; cuBLAS on CUDA)."""
    return F.linear(x, weight, bias)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear(silu_and_mul(gate_up), weight, bias)`: a gated MLP's down projection."""
    return F.linear(silu_and_mul(gate_up), weight, bias)


#: Largest finite E4M3 (`torch.float8_e4m3fn`) value.
FP8_MAX = 448.0


def fp8_block_supported(block: tuple[int, int] | None) -> bool:
    """Whether the FP8 kernels (`triton_fp8`) take this scale layout: None (one scale per
    output row) or `(bo, bi)` blocks that are powers of two >= 16."""
    if block is None:
        return True
    return all(b >= 16 and b & (b - 1) == 0 for b in block)


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """The float32 value of an FP8 weight `[N, K]`: `fp8 * scale`, with `scale` one float32
    per `block` (`[cdiv(N, bo), cdiv(K, bi)]`) or, with `block` None, one per output row
    (`[N]`)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if block is None:
        return w * s.reshape(-1, 1)
    bo, bi = block
    rows, cols = w.shape
    full = s.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return w * full


def linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`linear(x, dequantize_fp8(weight, scale, block), bias)`: the weight dequantized in
    float32, rounded once to x's dtype, then torch's `Linear`."""
    return F.linear(x, dequantize_fp8(weight, scale, block).to(x.dtype), bias)


def silu_mul_linear_fp8(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`linear_fp8(silu_and_mul(gate_up), weight, scale, bias, block)`."""
    return linear_fp8(silu_and_mul(gate_up), weight, scale, bias, block)


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(E4M3 weight, float32 scale)` of a float weight `[N, K]`, the inverse of
    `dequantize_fp8`: each block (or row) scaled by `amax / FP8_MAX` so its largest magnitude
    maps to 448, then rounded to nearest (an all-zero block gets scale 1). Computed in float32
    where `weight` lives (on CUDA: no host round trip)."""
    w = weight.to(torch.float32)
    if block is None:
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, scale
    bo, bi = block
    rows, cols = w.shape
    pr, pc = -(-rows // bo) * bo, -(-cols // bi) * bi
    padded = F.pad(w, (0, pc - cols, 0, pr - rows))
    tiles = padded.reshape(pr // bo, bo, pc // bi, bi)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


#: KV cache dtypes stored scaled (`quantize_kv`), with their largest finite value.
FP8_KV_MAX = {torch.float8_e4m3fn: 448.0}


def _kv_scale(cache: torch.Tensor, scale: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """The scale a KV op uses for `cache`: required for float8, None (unused) otherwise."""
    if cache.dtype not in FP8_KV_MAX:
        return None
    if scale is None:
        raise ValueError(f"a {cache.dtype} KV cache needs its {name}")
    return scale


def quantize_kv(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """`x` as stored in a cache of `dtype`: scaled and saturated float8, or a plain cast."""
    if dtype not in FP8_KV_MAX:
        return x.to(dtype)
    assert scale is not None
    fmax = FP8_KV_MAX[dtype]
    return (x.float() / scale.float()).clamp_(-fmax, fmax).to(dtype)


def dequantize_kv(
    stored: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None
) -> torch.Tensor:
    """Cache contents as `dtype` values: float8 x scale (computed in float32), or a cast."""
    if stored.dtype not in FP8_KV_MAX:
        return stored.to(dtype)
    assert scale is not None
    return (stored.float() * scale.float()).to(dtype)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store rows `k`/`v` `[T, Hk, D]` at flat slots of the `[NB, BS, Hk, D]` caches
    (quantized with the scales for a float8 cache)."""
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    for x, cache, scale in (
        (k, k_cache, _kv_scale(k_cache, k_scale, "k_scale")),
        (v, v_cache, _kv_scale(v_cache, v_scale, "v_scale")),
    ):
        rows = quantize_kv(x, cache.dtype, scale)
        if cache.dtype in FP8_KV_MAX:  # no float8 index_copy_ on the CPU: copy the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, heads, dim).index_copy_(0, slot_mapping, rows)


def _gather(
    cache: torch.Tensor, table: torch.Tensor, length: int, host: torch.Tensor | None = None
) -> torch.Tensor:
    """The first `length` positions of one sequence, `[length, Hk, D]`; negative table entries
    are blocks in `host` (high-speed swap: `metrale.cache.hss`)."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    ids = table[:nblocks].long()
    if host is not None and bool((ids < 0).any()):
        rows = torch.stack(
            [cache[int(b)] if b >= 0 else host[-int(b) - 1].to(cache.device) for b in ids.tolist()]
        )
    else:
        rows = cache.index_select(0, ids)
    return rows.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of query rows `[T, Hq, D]` over paged K/V (dequantized with the
    scales from a float8 cache); returns `[T, Hq, D]`."""
    scales = (_kv_scale(k_cache, k_scale, "k_scale"), _kv_scale(v_cache, v_scale, "v_scale"))
    out = torch.empty_like(q)
    host_k = host_v = None
    if meta.host_kv is not None:  # rows read host blocks: each sequence on its own below
        host_k, host_v = meta.host_kv.layer_tensors(k_cache)
    nd = meta.num_decode if host_k is None else 0
    rows = nd * meta.decode_query_len
    if nd:
        _decode_rows(q[:rows], out[:rows], k_cache, v_cache, meta, scale, sliding_window, scales)
    # The host copy of the row offsets (a device read only where a graph's metadata lacks it).
    starts = (
        (meta.query_start_loc_host or meta.query_start_loc.tolist()) if nd < meta.num_seqs else []
    )
    for b in range(nd, meta.num_seqs):
        start, end = starts[b], starts[b + 1]
        length = meta.seq_lens_host[b]
        qlen = end - start
        k = _gather(k_cache, meta.block_tables[b], length, host_k)
        v = _gather(v_cache, meta.block_tables[b], length, host_v)
        q_pos = torch.arange(length - qlen, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            dequantize_kv(k, q.dtype, scales[0]).transpose(0, 1).unsqueeze(0),
            dequantize_kv(v, q.dtype, scales[1]).transpose(0, 1).unsqueeze(0),
            attn_mask=mask[None, None],
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn[0].transpose(0, 1)
    return out


def _decode_rows(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> None:
    """All decode rows (`decode_query_len` = Q consecutive rows per sequence) in one padded
    gather + one SDPA call with a per-row causal mask."""
    ql = meta.decode_query_len
    nd = q.shape[0] // ql
    block_size = k_cache.shape[1]
    lens = meta.seq_lens[:nd].to(q.device)
    # A graph's metadata has no host lengths (a CPU run of a graph body): read the tensor.
    host = meta.seq_lens_host[:nd]
    max_len = max(host) if host else int(meta.seq_lens[:nd].max())
    nblocks = (max_len + block_size - 1) // block_size
    # index_select over the flat table: the same rows as `k_cache[tables]`, several times
    # faster on the CPU than advanced indexing (it was 10% of a small model's decode step).
    flat = meta.block_tables[:nd, :nblocks].reshape(-1).long()
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.index_select(0, flat).reshape(nd, nblocks * block_size, heads, dim)
    v = v_cache.index_select(0, flat).reshape(nd, nblocks * block_size, heads, dim)
    k, v = dequantize_kv(k, q.dtype, scales[0]), dequantize_kv(v, q.dtype, scales[1])
    k_pos = torch.arange(nblocks * block_size, device=q.device)
    if ql == 1:
        mask = k_pos[None, :] < lens[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > (lens[:, None] - 1 - sliding_window)
        attn = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [nd, Hq, 1, D]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        out.copy_(attn.squeeze(2))
        return
    # Row r of sequence b sits at position lens[b] - Q + r and sees keys up to it.
    q_pos = lens[:, None] - ql + torch.arange(ql, device=q.device)[None, :]  # [nd, Q]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [nd, Q, L]
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    attn = F.scaled_dot_product_attention(
        q.view(nd, ql, q.shape[1], q.shape[2]).transpose(1, 2),  # [nd, Hq, Q, D]
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None, :, :],
        scale=scale,
        enable_gqa=True,
    )
    out.copy_(attn.transpose(1, 2).reshape(out.shape))


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, Hq, D]` and k `[T, Hk, D]` by `positions` `[T]` with the layer's table
    `cos_sin` `[max_positions, 2, rotary_dim // 2]` (rotate-half layout; dims past
    `rotary_dim` pass through). The math of `metrale.layers.rotary.RotaryEmbedding.forward`."""
    table = cos_sin.index_select(0, positions)
    cos = table[:, 0].unsqueeze(1)
    sin = table[:, 1].unsqueeze(1)
    return _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    rot = x[..., :rotary_dim].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotary_dim == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


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
    """Qwen3's per-head q/k RMSNorm (weights `[D]`) followed by `rotary_embedding`."""
    return rotary_embedding(
        positions, rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps), cos_sin, rotary_dim
    )


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rotary_embedding` of q and k, then `write_kv` of the rotated k and of v; returns the
    rotated q. The attention layer's rotary step as one op (one kernel on CUDA)."""
    q, k = rotary_embedding(positions, q, k, cos_sin, rotary_dim)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def qk_norm_rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    rotary_dim: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qk_norm_rotary`, then `write_kv` of the rotated k and of v; returns the rotated q."""
    q, k = qk_norm_rotary(positions, q, k, q_weight, k_weight, eps, cos_sin, rotary_dim)
    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q
