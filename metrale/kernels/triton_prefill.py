"""Varlen causal attention for prefill chunks and mixed batches over the paged KV cache
(chunks that start after a cached prefix read it through the block table).

Owner: kernels. Re-exported by `triton_attention`; invariants are stated there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.metadata import AttentionMetadata
from metrale.kernels.triton_attention_common import (
    _LOG2E,
    _attend_tile,
    _check_cache_pair,
    attention_strides,
    interpreting,
    kv_scale_args,
    online_softmax_start,
    specialisation,
)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    qsl_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    window,
    max_blocks,
    first_seq,
    strides,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh = strides
    q_tile = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    if KV_FP8:  # float8 K/V: the K scale joins the score scale, the V scale the output
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    seq_len = tl.load(lens_ptr + seq)
    context = seq_len - q_len  # position of the chunk's first query token

    # Row r of the tile is query token q_tile*BLOCK_Q + r // GROUP, head r % GROUP of kv_head.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    heads = kv_head * GROUP + offs_m % GROUP
    q_pos = context + q_idx
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    token_row = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token_row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_mask[None, :],
        other=0.0,
    )
    first_pos = context + q_tile * BLOCK_Q
    last_pos = context + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
    m_i, l_i, acc = online_softmax_start(BLOCK_M, BLOCK_D)
    table_row = tables_ptr + seq.to(tl.int64) * stride_bt
    rows = (q, q_pos, row_ok, offs_d, d_mask, scale_log2, window)
    kv = (k_ptr, v_ptr, table_row, seq_len, max_blocks, kv_head, stride_cb, stride_cs, stride_ch)
    tile_end = tl.cdiv(last_pos + 1, BLOCK_N)
    if USE_WINDOW:
        masked_from = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
    else:
        # Tiles wholly at or before the first query position are visible to every row.
        masked_from = (first_pos + 1) // BLOCK_N
        for tile in range(0, masked_from):
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, rows, kv, tile, BLOCK_SIZE, BLOCK_N, False, USE_WINDOW, UPCAST, IEEE
            )
    for tile in range(masked_from, tile_end):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, rows, kv, tile, BLOCK_SIZE, BLOCK_N, True, USE_WINDOW, UPCAST, IEEE
        )
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + token_row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_mask[None, :],
    )


def _prefill_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M rows = query tokens x group heads, BLOCK_N keys, num_warps, num_stages)."""
    if interpreting():
        return 32, 16, 4, 1
    if dtype == torch.float32:
        return (32 if head_dim <= 128 else 16), 16, 8, 1
    if head_dim > 128:
        return 64, 32, 8, 2
    return 128, 64, 8, 2


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,
    first_seq: int,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for sequences `first_seq ..` of `meta` (rows located by
    `query_start_loc`), written into `out`. Uses the host `max_query_len` for the grid. A
    float8 cache needs `k_scale` / `v_scale`."""
    num_seqs = meta.seq_lens.shape[0] - first_seq
    if num_seqs <= 0:
        return out
    _check_cache_pair(k_cache, v_cache)
    k_scale, v_scale, fp8 = kv_scale_args(k_cache, k_scale, v_scale)
    q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q_heads % kv_heads != 0:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    group = q_heads // kv_heads
    cfg_m, cfg_n, num_warps, num_stages = _prefill_config(q.dtype, head_dim)
    block_m = max(block_m or cfg_m, 16, triton.next_power_of_2(group))
    block_n = block_n or cfg_n
    block_q = block_m // group
    if meta.query_lens_host:
        max_query_len = max(meta.query_lens_host[first_seq:], default=1)
    else:
        max_query_len = meta.max_query_len
    grid = (triton.cdiv(max(max_query_len, 1), block_q), num_seqs, kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        out,
        k_scale,
        v_scale,
        scale * _LOG2E,
        sliding_window or 0,
        meta.block_tables.shape[1],
        first_seq,
        attention_strides(q, k_cache, meta.block_tables, out),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        **specialisation(q, sliding_window, fp8),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
