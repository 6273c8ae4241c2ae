"""Torch reference implementations of the hot ops. They define what every Triton kernel must
compute, and they are the CPU path.

Owner: kernels.

Invariants:
- Float32 in, float32 out reproduces transformers' Llama-family math to rounding: RMSNorm
  normalises in float32 and casts back before the weight multiply, attention softmax runs in
  the input dtype through `scaled_dot_product_attention`.
- `paged_attention` reads K/V only through `block_tables`: a chunk that starts after a cached
  prefix and a decode row are the same computation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels.metadata import AttentionMetadata


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


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store rows `k`/`v` `[T, Hk, D]` at flat slots of the `[NB, BS, Hk, D]` caches."""
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of one sequence, `[length, Hk, D]`."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    rows = cache.index_select(0, table[:nblocks].long())
    return rows.reshape(-1, cache.shape[2], cache.shape[3])[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of query rows `[T, Hq, D]` over paged K/V; returns `[T, Hq, D]`."""
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    nd = meta.num_decode
    if nd:
        _decode_rows(q[:nd], out[:nd], k_cache, v_cache, meta, scale, sliding_window)
    for b in range(nd, meta.num_seqs):
        start, end = starts[b], starts[b + 1]
        length = meta.seq_lens_host[b]
        qlen = end - start
        k = _gather(k_cache, meta.block_tables[b], length)
        v = _gather(v_cache, meta.block_tables[b], length)
        q_pos = torch.arange(length - qlen, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype),
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
) -> None:
    """All single-token rows in one padded gather + one SDPA call."""
    nd = q.shape[0]
    block_size = k_cache.shape[1]
    lens = meta.seq_lens[:nd].to(q.device)
    max_len = max(meta.seq_lens_host[:nd])
    nblocks = (max_len + block_size - 1) // block_size
    tables = meta.block_tables[:nd, :nblocks].long()
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache[tables].reshape(nd, nblocks * block_size, heads, dim).to(q.dtype)
    v = v_cache[tables].reshape(nd, nblocks * block_size, heads, dim).to(q.dtype)
    k_pos = torch.arange(nblocks * block_size, device=q.device)
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
