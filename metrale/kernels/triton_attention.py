"""Triton kernels for attention over the paged KV cache: the KV write, paged decode attention
(GQA, split along the context, log-sum-exp combine), and varlen causal attention for prefill
chunks and mixed batches.

Owner: kernels. Each kernel computes the function of its torch reference in `reference.py`
(`write_kv`, `paged_attention`); `tests/gpu/test_kernels.py` checks them against it.

Invariants:
- K/V are read only through `block_tables` and written only at `slot_mapping`; a slot < 0 is
  skipped (no write), a padded row's slot in the null block 0 is written there.
- Decode is CUDA-graph capturable: no host sync and no host mirror is read; the grid is
  `(rows, kv_heads, num_splits)` where `num_splits` depends only on the row count, the head
  count and `block_tables.shape[1]`, and each program reads its sequence length from device
  memory and derives its share of the context from it. A row with `seq_len == 0` writes
  zeros; every row writes every element of its output (no NaN, no unwritten memory).
- One program handles all query heads of one KV head (GQA), so K/V are read once per KV head;
  scores, softmax and the output accumulator are float32 whatever the input dtype.
- The prefill kernel may take the host `max_query_len` for its grid (prefill is not graphed).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from metrale.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634

#: Shortest share of the context one decode split takes (tokens), so short contexts do not
#: pay for a reduction over many near-empty splits.
MIN_SPLIT_TOKENS = 256
#: Most splits of one decode row (partials cost `splits * head_dim * 4` bytes per head).
MAX_SPLITS = 64


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a fixed small number on the CPU interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


# -------------------------------------------------------------------------------------------
# Shared device helpers
# -------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """`a @ b` accumulated in float32. UPCAST: operands as float32 (the CPU interpreter
    mis-computes bf16 dots); IEEE: exact float32 products (no tf32) for float32 inputs."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    k_ptr,
    v_ptr,
    table_row_ptr,
    tile,
    q_pos,
    row_ok,
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
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One online-softmax step over the context tokens `tile*BLOCK_N ..` of one sequence.

    Rows of `q` `[M, D]` sit at positions `q_pos` `[M]`; a row attends to keys at positions
    `<= q_pos` (and `> q_pos - window` with a window). MASKED=False promises every key of the
    tile is visible to every row (interior causal tiles), which skips the masking.
    """
    k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    blk = k_pos // BLOCK_SIZE
    in_ctx = (k_pos < seq_len) & (blk < max_blocks)
    page = tl.load(table_row_ptr + blk, mask=in_ctx, other=0)
    offs = (
        page.to(tl.int64) * stride_cb
        + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_cs
        + kv_head.to(tl.int64) * stride_ch
    )
    kv_mask = in_ctx[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k.to(q.dtype)), UPCAST, IEEE) * scale_log2
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & in_ctx[None, :] & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf: shift by 0 instead (no NaN).
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
    return acc, m_new, l_i


# -------------------------------------------------------------------------------------------
# KV write
# -------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    i = tl.arange(0, BLOCK_HD)
    head = i // HEAD_DIM
    d = i % HEAD_DIM
    mask = i < HEADS * HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + d
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store rows `k`/`v` `[T, Hk, D]` at flat slots of the `[NB, BS, Hk, D]` caches (one
    launch for both). Same function as `reference.write_kv`; slots < 0 are skipped."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    _check_cache_pair(k_cache, v_cache)
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    block_hd = triton.next_power_of_2(heads * dim)
    _write_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEADS=heads,
        HEAD_DIM=dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_HD=block_hd,
        num_warps=max(1, min(8, block_hd // 256)),
    )


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("K and V caches must have the same shape and strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("KV cache rows must be contiguous in head_dim")


# -------------------------------------------------------------------------------------------
# Paged decode attention (one query token per row), split along the context
# -------------------------------------------------------------------------------------------


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
):
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
):
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
) -> torch.Tensor:
    """Attention of one query token per row, `q` `[R, Hq, D]`, over row r's first
    `seq_lens[r]` cached positions read through `block_tables[r]`; returns `[R, Hq, D]`.

    Graph-safe: reads no host data; the launch shape depends on `R`, the heads and
    `block_tables.shape[1]` only. `num_splits` and `min_split_tokens` override the split
    count and the shortest split (tests use them to exercise splits on short contexts).
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
        MIN_TILES=max(1, (min_split_tokens or MIN_SPLIT_TOKENS) // block_n),
        USE_WINDOW=sliding_window is not None,
        UPCAST=interpreting(),
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
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
            num_warps=4 if head_dim * num_splits >= 2048 else 1,
        )
    return out


# -------------------------------------------------------------------------------------------
# Prefill chunks and mixed batches: varlen causal attention over paged K/V
# -------------------------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    qsl_ptr,
    out_ptr,
    scale_log2,
    window,
    max_blocks,
    first_seq,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
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
):
    q_tile = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
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
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_bt
    tile_end = tl.cdiv(last_pos + 1, BLOCK_N)
    if USE_WINDOW:
        masked_from = tl.maximum(first_pos - window + 1, 0) // BLOCK_N
    else:
        # Tiles wholly at or before the first query position are visible to every row.
        masked_from = (first_pos + 1) // BLOCK_N
        for tile in range(0, masked_from):
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
                row_ok,
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
                False,
                USE_WINDOW,
                UPCAST,
                IEEE,
            )
    for tile in range(masked_from, tile_end):
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
            row_ok,
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
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
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
) -> torch.Tensor:
    """Causal attention for sequences `first_seq ..` of `meta` (rows located by
    `query_start_loc`), written into `out`. Uses the host `max_query_len` for the grid."""
    num_seqs = meta.seq_lens.shape[0] - first_seq
    if num_seqs <= 0:
        return out
    _check_cache_pair(k_cache, v_cache)
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
        scale * _LOG2E,
        sliding_window or 0,
        meta.block_tables.shape[1],
        first_seq,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        meta.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        USE_WINDOW=sliding_window is not None,
        UPCAST=interpreting(),
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of query rows `[T, Hq, D]` over paged K/V; returns `[T, Hq, D]`.

    Same function as `reference.paged_attention`: the first `num_decode` sequences (one row
    each) go to the split-context decode kernel, the rest to the varlen prefill kernel. A
    batch of decode rows only reads no host data (graph-capturable).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    num_decode = meta.num_decode
    if num_decode:
        decode_attention(
            q[:num_decode],
            k_cache,
            v_cache,
            meta.seq_lens[:num_decode],
            meta.block_tables[:num_decode],
            scale,
            sliding_window,
            out=out[:num_decode],
        )
    if meta.seq_lens.shape[0] > num_decode:
        prefill_attention(q, k_cache, v_cache, meta, scale, sliding_window, out, num_decode)
    return out
