"""The Triton GEMV's device helpers: streaming `[BLOCK_N, BLOCK_K]` tiles of W along K and
applying each to up to 8 rows of x (`_stream_tiles`), then reducing and storing each row
(`_store_rows`). `triton_gemv`'s GEMV and `triton_fp8`'s FP8-weight GEMV are built from them.

Owner: kernels.

Invariants:
- Every row of x has a `[BLOCK_N, BLOCK_K]` float32 accumulator updated elementwise (loads
  and FMAs only in the loop); the cross-thread reduction runs once, at the store.
- `triton_fp8`'s K-column block scales (`_load_sx`, BLOCK_SCALE) and row scales (ROW_SCALE)
  are constexpr branches the bf16/fp16/fp32 GEMV compiles out; ACT (`gemv_silu_mul`) computes
  `silu(gate) * up` while loading x, rounded to the input dtype after each step as the
  reference rounds it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import gdc_launch_dependents, gdc_wait


@triton.jit
def _load_x(ptrs, mask, half, EVEN_K: tl.constexpr, ACT: tl.constexpr):
    """x at `ptrs` as float32; with ACT, `silu(gate) * up` of the gate/up row (gate at `ptrs`,
    up `half` elements later), rounded to the input dtype after each step as the reference."""
    if EVEN_K:
        a = tl.load(ptrs, eviction_policy="evict_last")
    else:
        a = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    if ACT:
        if EVEN_K:
            u = tl.load(ptrs + half, eviction_policy="evict_last")
        else:
            u = tl.load(ptrs + half, mask=mask, other=0.0, eviction_policy="evict_last")
        g = a.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(a.dtype).to(tl.float32)
        out = (act * u.to(tl.float32)).to(a.dtype).to(tl.float32)
    else:
        out = a.to(tl.float32)
    return out


@triton.jit
def _fma_row(acc, w, ptrs, mask, half, sx, EVEN_K: tl.constexpr, ACT: tl.constexpr,
             X2D: tl.constexpr, BLOCK_SCALE: tl.constexpr):  # fmt: skip
    """`acc + w * x` for one row of x: `[BLOCK_N, BLOCK_K]` elementwise, no reduction (x
    times the tile's K-column scales `sx` with BLOCK_SCALE: `triton_fp8`'s block scales)."""
    x = _load_x(ptrs, mask, half, EVEN_K, ACT)
    if BLOCK_SCALE:
        x = x * sx
    if X2D:
        out = acc + w * x
    else:
        out = acc + w * x[None, :]
    return out


@triton.jit
def _zero_accs(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """The 8 row accumulators (float32 zeros; rows past M stay unused): `[BLOCK_N, BLOCK_K]`,
    or with G > 0 the grouped tile's `[BLOCK_N, G, BLOCK_K // G]`."""
    if G > 0:
        acc = tl.zeros([BLOCK_N, G, BLOCK_K // G], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc, acc, acc, acc, acc, acc, acc, acc


@triton.jit
def _load_w(w_ptrs, k, offs_k, k_hi, EVEN_K: tl.constexpr):
    """The `[BLOCK_N, BLOCK_K]` W tile at K offset `k`, as float32 (streamed: evict-first)."""
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        k_mask = (k + offs_k) < k_hi
        w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
    return w.to(tl.float32)


@triton.jit
def _apply_tile(
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptrs, x_mask, stride_xm, half, sx,
    M: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr, X2D: tl.constexpr,
    BLOCK_SCALE: tl.constexpr,
):  # fmt: skip
    """One W tile applied to each of the M rows of x (accumulators past M untouched)."""
    acc0 = _fma_row(acc0, w, x_ptrs, x_mask, half, sx, EVEN_K, ACT, X2D, BLOCK_SCALE)
    if M > 1:
        acc1 = _fma_row(acc1, w, x_ptrs + stride_xm, x_mask, half, sx, EVEN_K, ACT, X2D,
                        BLOCK_SCALE)  # fmt: skip
    if M > 2:
        acc2 = _fma_row(acc2, w, x_ptrs + 2 * stride_xm, x_mask, half, sx, EVEN_K, ACT, X2D,
                        BLOCK_SCALE)  # fmt: skip
    if M > 3:
        acc3 = _fma_row(acc3, w, x_ptrs + 3 * stride_xm, x_mask, half, sx, EVEN_K, ACT, X2D,
                        BLOCK_SCALE)  # fmt: skip
    if M > 4:
        acc4 = _fma_row(acc4, w, x_ptrs + 4 * stride_xm, x_mask, half, sx, EVEN_K, ACT, X2D,
                        BLOCK_SCALE)  # fmt: skip
    if M > 5:
        acc5 = _fma_row(acc5, w, x_ptrs + 5 * stride_xm, x_mask, half, sx, EVEN_K, ACT, X2D,
                        BLOCK_SCALE)  # fmt: skip
    if M > 6:
        acc6 = _fma_row(acc6, w, x_ptrs + 6 * stride_xm, x_mask, half, sx, EVEN_K, ACT, X2D,
                        BLOCK_SCALE)  # fmt: skip
    if M > 7:
        acc7 = _fma_row(acc7, w, x_ptrs + 7 * stride_xm, x_mask, half, sx, EVEN_K, ACT, X2D,
                        BLOCK_SCALE)  # fmt: skip
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _store_row(out_ptr, b_ptr, s_ptr, acc, row, offs_n, n_mask, stride_om,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, ROW_SCALE: tl.constexpr):  # fmt: skip
    """Reduce `acc` over K and store it as row `row` of the output (ROW_SCALE: times the
    output rows' scales at `s_ptr`, `triton_fp8`'s row scales; PARTIAL: float32, into this
    split's slice of the workspace, bias left to the reduction)."""
    y = tl.sum(acc, axis=1)
    if ROW_SCALE:
        y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if PARTIAL:
        tl.store(out_ptr + row * stride_om + offs_n, y, mask=n_mask)
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _store_rows(
    out_ptr, b_ptr, s_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, offs_n, n_mask,
    stride_om, M: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    ROW_SCALE: tl.constexpr,
):  # fmt: skip
    """`_store_row` of each of the M rows."""
    _store_row(out_ptr, b_ptr, s_ptr, acc0, 0, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
               ROW_SCALE)  # fmt: skip
    if M > 1:
        _store_row(out_ptr, b_ptr, s_ptr, acc1, 1, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
                   ROW_SCALE)  # fmt: skip
    if M > 2:
        _store_row(out_ptr, b_ptr, s_ptr, acc2, 2, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
                   ROW_SCALE)  # fmt: skip
    if M > 3:
        _store_row(out_ptr, b_ptr, s_ptr, acc3, 3, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
                   ROW_SCALE)  # fmt: skip
    if M > 4:
        _store_row(out_ptr, b_ptr, s_ptr, acc4, 4, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
                   ROW_SCALE)  # fmt: skip
    if M > 5:
        _store_row(out_ptr, b_ptr, s_ptr, acc5, 5, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
                   ROW_SCALE)  # fmt: skip
    if M > 6:
        _store_row(out_ptr, b_ptr, s_ptr, acc6, 6, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
                   ROW_SCALE)  # fmt: skip
    if M > 7:
        _store_row(out_ptr, b_ptr, s_ptr, acc7, 7, offs_n, n_mask, stride_om, HAS_BIAS, PARTIAL,
                   ROW_SCALE)  # fmt: skip


@triton.jit
def _load_sx(s_row_ptr, k, offs_k, K, BLOCK_K: tl.constexpr, BI: tl.constexpr,
             BLOCK_SCALE: tl.constexpr):  # fmt: skip
    """The block scales of the tile's K columns (`[BLOCK_K]`; 1.0 without block scales)."""
    if BLOCK_SCALE:
        kk = k + offs_k
        sx = tl.load(s_row_ptr + kk // BI, mask=kk < K, other=0.0, eviction_policy="evict_last")
    else:
        sx = tl.full([BLOCK_K], 1.0, tl.float32)
    return sx


@triton.jit
def _stream_tiles(
    w_ptrs, x_ptrs, s_row_ptr, k_lo, k_hi, offs_k, x_offs, stride_xm, half,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, ACT: tl.constexpr, X2D: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    BI: tl.constexpr, PDL: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """The W tiles of K range `[k_lo, k_hi)` (and, BLOCK_SCALE, their K-column scales from
    `s_row_ptr`) applied to the M rows of x: the 8 row accumulators. The first tile is peeled
    off the loop and loaded before waiting on the previous kernel (PDL): W does not depend on
    it, so its latency hides behind that kernel's tail; once the loads are done the next
    kernel may launch. G > 0: grouped tiles `[BLOCK_N, G, BLOCK_K // G]` (the caller's
    pointers are shaped so, `offs_k` holds each group's first column, X2D)."""
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _zero_accs(BLOCK_N, BLOCK_K, G)
    w = _load_w(w_ptrs, k_lo, offs_k, k_hi, EVEN_K)
    sx = _load_sx(s_row_ptr, k_lo, offs_k, k_hi, BLOCK_K, BI, BLOCK_SCALE)
    if PDL:
        gdc_wait()
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _apply_tile(
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptrs, (k_lo + x_offs) < k_hi,
        stride_xm, half, sx, M, EVEN_K, ACT, X2D, BLOCK_SCALE,
    )  # fmt: skip
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    for k in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        w = _load_w(w_ptrs, k, offs_k, k_hi, EVEN_K)
        sx = _load_sx(s_row_ptr, k, offs_k, k_hi, BLOCK_K, BI, BLOCK_SCALE)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _apply_tile(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptrs, (k + x_offs) < k_hi,
            stride_xm, half, sx, M, EVEN_K, ACT, X2D, BLOCK_SCALE,
        )  # fmt: skip
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PDL:
        gdc_launch_dependents()
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7
