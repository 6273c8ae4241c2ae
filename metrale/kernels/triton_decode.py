"""Paged decode attention: one query row per sequence, GQA grouped per program, the context
split into `num_splits` shares combined with the log-sum-exp trick; CUDA-graph capturable.

Owner: kernels. Re-exported by `triton_attention`; invariants are stated there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import (
    _LOG2E,
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    _attend_tile,
    _check_cache_pair,
    gdc_launch_dependents,
    gdc_wait,
    interpreting,
    multiprocessor_count,
    pdl_options,
)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_lse_ptr,
    scale_log2,
    window,
    max_blocks,
    num_q_heads,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_TILES: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: see triton_attention_common
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.maximum(tl.load(lens_ptr + row), 0)
    lo = seq_len * 0
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # This split's share of the tiles covering [lo, seq_len); a split past the end is empty.
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tile_hi - tile_lo, NUM_SPLITS), MIN_TILES)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_hi)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(
        q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (seq_len - 1)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    table_row = tables_ptr + row.to(tl.int64) * stride_bt
    for tile in range(t_begin, t_end):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            k_ptr,
            v_ptr,
            table_row,
            tile,
            q_pos,
            h_mask,
            seq_len,
            window,
            max_blocks,
            kv_head,
            stride_cb,
            stride_cs,
            stride_ch,
            scale_log2,
            offs_d,
            d_mask,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            USE_WINDOW,
            UPCAST,
            IEEE,
        )
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    store_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partials [rows, Hq, NUM_SPLITS, HEAD_DIM] (normalised) and lse [rows, Hq, NUM_SPLITS].
        base = (row.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=h_mask)


@triton.jit
def _decode_combine_kernel(
    part_acc_ptr,
    part_lse_ptr,
    out_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    base = (row.to(tl.int64) * num_q_heads + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s)
    m = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    total = tl.sum(weight, 0)
    part = tl.load(
        part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def decode_num_splits(
    rows: int, kv_heads: int, max_blocks: int, block_size: int, device: torch.device
) -> int:
    """Context splits of a decode launch: a power of two from static quantities only (rows,
    heads, block-table width), enough programs for about two per multiprocessor."""
    if rows == 0:
        return 1
    capacity = max_blocks * block_size
    by_length = max(1, capacity // MIN_SPLIT_TOKENS)
    wanted = math.ceil(2 * multiprocessor_count(device) / (rows * kv_heads))
    splits = min(triton.next_power_of_2(max(wanted, 1)), MAX_SPLITS)
    while splits > 1 and splits > by_length:
        splits //= 2
    return splits


def _decode_config(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N tokens per tile, num_warps, num_stages) for decode. Float32 takes small tiles:
    its exact (non-tf32) dots run on FMA units and spill with larger ones (ptxas, sm_90)."""
    if interpreting():
        return 32, 4, 1
    if dtype == torch.float32:
        return 16, 4, 2
    if head_dim > 128:
        return 32, 4, 2
    return 64, 4, 2


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    min_split_tokens: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of one query token per row, `q` `[R, Hq, D]`, over row r's first
    `seq_lens[r]` cached positions read through `block_tables[r]`; returns `[R, Hq, D]`.

    Graph-safe: reads no host data; the launch shape depends on `R`, the heads and
    `block_tables.shape[1]` only. `num_splits` overrides the split count; `min_split_tokens`
    (default: one tile) is the least context a non-empty split takes. `pdl`: launch as
    programmatic dependents of the previous kernel (sm_90+).
    """
    rows, q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if rows == 0:
        return out
    _check_cache_pair(k_cache, v_cache)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q_heads % kv_heads != 0:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = q_heads // kv_heads
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = decode_num_splits(rows, kv_heads, max_blocks, block_size, q.device)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    block_n, num_warps, num_stages = _decode_config(q.dtype, head_dim)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_acc = torch.empty(
            (rows, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((rows, q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_lse = out  # unused
    _decode_kernel[(rows, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_lse,
        scale * _LOG2E,
        sliding_window or 0,
        max_blocks,
        q_heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        MIN_TILES=max(1, (min_split_tokens or block_n) // block_n),
        USE_WINDOW=sliding_window is not None,
        UPCAST=interpreting(),
        IEEE=q.dtype == torch.float32,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_options(pdl),
    )
    if num_splits > 1:
        _decode_combine_kernel[(rows, q_heads)](
            part_acc,
            part_lse,
            out,
            q_heads,
            out.stride(0),
            out.stride(1),
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            PDL=pdl,
            num_warps=4 if head_dim * num_splits >= 2048 else 1,
            **pdl_options(pdl),
        )
    return out


# -------------------------------------------------------------------------------------------
# Prefill chunks and mixed batches: varlen causal attention over paged K/V
# -------------------------------------------------------------------------------------------
