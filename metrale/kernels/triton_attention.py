"""Triton kernels for attention over the paged KV cache: the KV write, paged decode attention
(GQA, split along the context, log-sum-exp combine), and varlen causal attention for prefill
chunks and mixed batches.

Owner: kernels. Each kernel computes the function of its torch reference in `reference.py`
(`write_kv`, `paged_attention`); `tests/gpu/test_kernels.py` checks them against it.

Invariants:
- K/V are read only through `block_tables` and written only at `slot_mapping`; a slot < 0 is
  skipped (no write), a padded row's slot in the null block 0 is written there.
- Decode is CUDA-graph capturable: no host sync and no host mirror is read; the grid is
  `(sequences, kv_heads, num_splits)` where `num_splits` depends only on the sequence count,
  the head count and `block_tables.shape[1]`, and each program reads its sequence length from
  device memory and derives its share of the context from it. A row with `seq_len == 0`
  writes zeros; every row writes every element of its output (no NaN, no unwritten memory).
- Decode sequences own `decode_query_len` (Q, a compile-time constant) consecutive rows: one
  program handles all Q x GROUP query rows of one KV head (GQA and the verify tokens), so K/V
  are read once per KV head whatever Q; row j of a sequence sees keys up to its position
  `seq_len - Q + j`. Q = 1 compiles to the plain decode kernel. Scores, softmax and the
  output accumulator are float32 whatever the input dtype.
- The prefill kernel may take the host `max_query_len` for its grid (prefill is not graphed).
- A float8 cache (`KV_FP8`): writers store `reference.quantize_kv` of each row (the same
  bytes as the reference); readers convert float8 to the query dtype exactly and fold the
  scales in float32: the K scale into the score scale, the V scale into the normalised
  output (before the split partials), so dequantization costs two scalar loads per program.
  The scales are read from device memory at run time (graph-capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.metadata import AttentionMetadata
from metrale.kernels.triton_attention_common import (
    _check_cache_pair,
    _quantize_kv,
    kv_scale_args,
)
from metrale.kernels.triton_decode import decode_attention, decode_num_splits
from metrale.kernels.triton_prefill import prefill_attention

__all__ = [
    "decode_attention",
    "decode_num_splits",
    "paged_attention",
    "prefill_attention",
    "write_kv",
]


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_HD: tl.constexpr,
    KV_FP8: tl.constexpr = False,
):  # fmt: skip
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
    if KV_FP8:
        k = _quantize_kv(k.to(tl.float32), tl.load(k_scale_ptr), True, k_cache_ptr.dtype.element_ty)
        v = _quantize_kv(v.to(tl.float32), tl.load(v_scale_ptr), True, v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Store rows `k`/`v` `[T, Hk, D]` at flat slots of the `[NB, BS, Hk, D]` caches (one
    launch for both; quantized with the scales for a float8 cache). Same function as
    `reference.write_kv`; slots < 0 are skipped."""
    tokens = k.shape[0]
    _check_cache_pair(k_cache, v_cache)
    k_scale, v_scale, fp8 = kv_scale_args(k_cache, k_scale, v_scale)
    if tokens == 0:
        return
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
        k_scale,
        v_scale,
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
        KV_FP8=fp8,
        num_warps=max(1, min(8, block_hd // 256)),
    )


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None, *, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of query rows `[T, Hq, D]` over paged K/V (float8 K/V dequantized
    with `k_scale` / `v_scale`); returns `[T, Hq, D]`.

    Same function as `reference.paged_attention`: the first `meta.attention_decode_seqs`
    sequences (`meta.decode_query_len` rows each: 1 for decode, k + 1 for a speculative verify
    step; one-token prompt chunks count when every chunk is one) go to the split-context
    decode kernel, the rest to the varlen prefill kernel. A batch of decode rows only reads no host data
    (graph-capturable). With high-speed swap (`meta.host_kv`, a `metrale.cache.hss.HssStaging`)
    both kernels read the staging's scratch cache instead (eager forwards only).
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if meta.host_kv is not None:  # high-speed swap: this layer's blocks gathered on the device
        k_cache, v_cache, meta = meta.host_kv.stage(k_cache, v_cache, meta)
    out = torch.empty_like(q)
    num_decode = meta.attention_decode_seqs
    if num_decode:
        rows = num_decode * meta.decode_query_len
        decode_attention(
            q[:rows],
            k_cache,
            v_cache,
            meta.seq_lens[:num_decode],
            meta.block_tables[:num_decode],
            scale,
            sliding_window,
            out=out[:rows],
            pdl=pdl,
            query_len=meta.decode_query_len,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if meta.seq_lens.shape[0] > num_decode:
        prefill_attention(
            q, k_cache, v_cache, meta, scale, sliding_window, out, num_decode,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return out
