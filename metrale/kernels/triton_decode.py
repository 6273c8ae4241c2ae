"""Paged decode attention: Q query rows per sequence (Q = 1: decode; Q = k + 1: a speculative
verify step, causal among themselves), GQA grouped per program, the context split into
`num_splits` shares combined with the log-sum-exp trick; CUDA-graph capturable.

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
    attention_strides,
    interpreting,
    kv_scale_args,
    multiprocessor_count,
    online_softmax_start,
    pdl_enter,
    pdl_options,
    specialisation,
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
    k_scale_ptr,
    v_scale_ptr,
    scale_log2,
    window,
    max_blocks,
    num_q_heads,
    strides,
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
    QUERY_LEN: tl.constexpr = 1,
    ROW_CHUNKS: tl.constexpr = 1,
    KV_FP8: tl.constexpr = False,
):
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh = strides
    # One program: sequence `row`, KV head, context split; all QUERY_LEN * GROUP query rows of
    # that KV head (in ROW_CHUNKS programs of BLOCK_H rows when they do not fit one). Q = 1
    # keeps the plain decode code: every QUERY_LEN > 1 / ROW_CHUNKS > 1 branch is constexpr.
    pdl_enter(PDL)  # programmatic dependent launch: see triton_attention_common
    if KV_FP8:  # float8 K/V: the K scale joins the score scale, the V scale the output
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    row = tl.program_id(0)
    if ROW_CHUNKS == 1:
        kv_head = tl.program_id(1)
    else:
        kv_head = tl.program_id(1) // ROW_CHUNKS
    split = tl.program_id(2)
    seq_len = tl.maximum(tl.load(lens_ptr + row), 0)
    lo = seq_len * 0
    if USE_WINDOW:
        if QUERY_LEN == 1:
            lo = tl.maximum(seq_len - window, 0)
        else:  # the first query row (position seq_len - QUERY_LEN) sees the earliest keys
            lo = tl.maximum(seq_len - window - (QUERY_LEN - 1), 0)
    # This split's share of the tiles covering [lo, seq_len); a split past the end is empty.
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tile_hi - tile_lo, NUM_SPLITS), MIN_TILES)
    t_begin = tile_lo + split * per_split
    t_end = tl.minimum(t_begin + per_split, tile_hi)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if QUERY_LEN == 1:
        h_mask = offs_h < GROUP
        heads = kv_head * GROUP + offs_h
        q = tl.load(
            q_ptr + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (seq_len - 1)
    else:
        # Block row i is query token `i // GROUP` of the sequence (token row
        # `row * QUERY_LEN + i // GROUP`), head `i % GROUP` of the KV head's group.
        if ROW_CHUNKS == 1:
            local = offs_h
        else:
            local = (tl.program_id(1) % ROW_CHUNKS) * BLOCK_H + offs_h
        tok = local // GROUP
        h_mask = local < QUERY_LEN * GROUP
        heads = kv_head * GROUP + local % GROUP
        q_rows = row.to(tl.int64) * QUERY_LEN + tok
        q = tl.load(
            q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        # Causal among the sequence's own rows: token j sits at seq_len - QUERY_LEN + j.
        q_pos = seq_len - QUERY_LEN + tok
    m_i, l_i, acc = online_softmax_start(BLOCK_H, BLOCK_D)
    table_row = tables_ptr + row.to(tl.int64) * stride_bt
    rows = (q, q_pos, h_mask, offs_d, d_mask, scale_log2, window)
    kv = (k_ptr, v_ptr, table_row, seq_len, max_blocks, kv_head, stride_cb, stride_cs, stride_ch)
    for tile in range(t_begin, t_end):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, rows, kv, tile, BLOCK_SIZE, BLOCK_N, True, USE_WINDOW, UPCAST, IEEE
        )
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    store_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        if QUERY_LEN == 1:
            out_rows = out_ptr + row.to(tl.int64) * stride_ot
        else:
            out_rows = out_ptr + q_rows[:, None] * stride_ot
        tl.store(
            out_rows + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partials [token rows, Hq, NUM_SPLITS, HEAD_DIM] (normalised) and lse
        # [token rows, Hq, NUM_SPLITS]; the combine runs per token row and head.
        if QUERY_LEN == 1:
            base = (row.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split
        else:
            base = (q_rows * num_q_heads + heads) * NUM_SPLITS + split
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
    pdl_enter(PDL)
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


def _decode_config(dtype: torch.dtype, head_dim: int, num_splits: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N tokens per tile, num_warps, num_stages) for decode. Float32 takes small tiles:
    its exact (non-tf32) dots run on FMA units and spill with larger ones (ptxas, sm_90).
    An unsplit launch (many rows: each program walks its whole context) keeps three tiles
    in flight instead of two: at 128 rows x 8 KV heads, bf16, head_dim 128 on the H200 it
    streams the cache 4-5% faster (3.84 against 3.71 TB/s at context 640, 4.00 against 3.82
    at 1,100; `tools/sweep_decode_attention.py`), with the same output bit for bit (the same
    tiles in the same order). Split launches (few rows) keep two."""
    if interpreting():
        return 32, 4, 1
    if dtype == torch.float32:
        return 16, 4, 2
    if head_dim > 128:
        return 32, 4, 2
    return 64, 4, 3 if num_splits == 1 else 2


#: Most query rows (tokens x GQA group) one verify program holds; more are dealt over
#: `ROW_CHUNKS` programs per KV head (each reads the K/V tiles again, mostly from L2).
MAX_BLOCK_H = 128


def _verify_config(dtype: torch.dtype, head_dim: int, block_h: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for Q > 1 with `block_h` rows per program: the decode
    tiles, with 8 warps from 32 rows on (sm_90 ptxas, Qwen3-8B shapes: bf16 32 rows take 160
    registers with 4 warps, 102 with 8; fp32 32 rows spill with 4 warps; 128 rows take 174
    registers with 8 warps, no spill)."""
    block_n, num_warps, num_stages = _decode_config(dtype, head_dim)
    if interpreting() or block_h < 32:
        return block_n, num_warps, num_stages
    return block_n, 8, num_stages


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
    query_len: int = 1,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query_len` (Q) query tokens per sequence, `q` `[S * Q, Hq, D]` (rows
    `s * Q .. s * Q + Q - 1` belong to sequence s), over sequence s's first `seq_lens[s]`
    cached positions read through `block_tables[s]`; returns `[S * Q, Hq, D]`. Token j of
    sequence s sits at position `seq_lens[s] - Q + j` and sees keys up to it (Q = 1: decode;
    Q = k + 1: a speculative verify step).

    Graph-safe: reads no host data; the launch shape depends on `S`, `Q`, the heads and
    `block_tables.shape[1]` only. `num_splits` overrides the split count; `min_split_tokens`
    (default: one tile) is the least context a non-empty split takes. `pdl`: launch as
    programmatic dependents of the previous kernel (sm_90+). A float8 cache needs
    `k_scale` / `v_scale` (`[1]` float32, read on the device).
    """
    rows, q_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    if query_len < 1 or rows % query_len:
        raise ValueError(f"{rows} query rows are not a multiple of query_len {query_len}")
    seqs = rows // query_len
    if rows == 0:
        return out
    _check_cache_pair(k_cache, v_cache)
    k_scale, v_scale, fp8 = kv_scale_args(k_cache, k_scale, v_scale)
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q_heads % kv_heads != 0:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} KV heads")
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = q_heads // kv_heads
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = decode_num_splits(seqs, kv_heads, max_blocks, block_size, q.device)
    if num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    if query_len == 1:
        block_h, row_chunks = max(16, triton.next_power_of_2(group)), 1
        block_n, num_warps, num_stages = _decode_config(q.dtype, head_dim, num_splits)
        variant: dict[str, int] = {}
    else:
        per_kv_head = query_len * group
        row_chunks = triton.cdiv(per_kv_head, MAX_BLOCK_H)
        block_h = max(16, triton.next_power_of_2(triton.cdiv(per_kv_head, row_chunks)))
        block_n, num_warps, num_stages = _verify_config(q.dtype, head_dim, block_h)
        variant = {"QUERY_LEN": query_len, "ROW_CHUNKS": row_chunks}
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_acc = torch.empty(
            (rows, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((rows, q_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_lse = out  # unused
    _decode_kernel[(seqs, kv_heads * row_chunks, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_lse,
        k_scale,
        v_scale,
        scale * _LOG2E,
        sliding_window or 0,
        max_blocks,
        q_heads,
        attention_strides(q, k_cache, block_tables, out),
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        MIN_TILES=max(1, (min_split_tokens or block_n) // block_n),
        PDL=pdl,
        **specialisation(q, sliding_window, fp8),
        num_warps=num_warps,
        num_stages=num_stages,
        **variant,
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
