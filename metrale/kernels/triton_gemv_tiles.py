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
- NORM (`gemv_norm`, `gemv_fp8_norm`: the pre-norm fused into the projection) computes
  `rms_norm(residual + x)` while loading x, each step rounded as `reference.add_rms_norm`
  rounds it, so the projection sees the same input as after the separate norm (the float32
  sum of squares may differ in order). Every program reads the whole rows once for their
  scale (`_norm_rstds`, after the PDL wait); exactly one writes the rounded sums.
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
def _load_x_normed(ptrs, mask, r_ptrs, nw, rstd, EVEN_K: tl.constexpr, ADD: tl.constexpr):
    """x of a NORM GEMV as float32: `rms_norm(residual + x)` of the row's columns at `ptrs`
    (the residual at `r_ptrs` with ADD), given the row's `rstd` and the columns' norm weights
    `nw` (float32), rounded to the input dtype at each step as `reference.add_rms_norm`:
    the sum, the normalised row before the weight, the product."""
    if EVEN_K:
        a = tl.load(ptrs, eviction_policy="evict_last")
    else:
        a = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    s = a.to(tl.float32)
    if ADD:
        if EVEN_K:
            r = tl.load(r_ptrs, eviction_policy="evict_last")
        else:
            r = tl.load(r_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
        s = (s + r.to(tl.float32)).to(a.dtype).to(tl.float32)
    return ((s * rstd).to(a.dtype).to(tl.float32) * nw).to(a.dtype).to(tl.float32)


@triton.jit
def _fma_row(acc, w, ptrs, mask, half, sx, r_ptrs, nw, rstd, EVEN_K: tl.constexpr,
             ACT: tl.constexpr, X2D: tl.constexpr, BLOCK_SCALE: tl.constexpr,
             NORM: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    """`acc + w * x` for one row of x: `[BLOCK_N, BLOCK_K]` elementwise, no reduction (x
    times the tile's K-column scales `sx` with BLOCK_SCALE: `triton_fp8`'s block scales;
    NORM: x is `_load_x_normed`'s row)."""
    if NORM:
        x = _load_x_normed(ptrs, mask, r_ptrs, nw, rstd, EVEN_K, ADD)
    else:
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
    r_ptrs, nw, rs0, rs1, rs2, rs3, rs4, rs5, rs6, rs7,
    M: tl.constexpr, EVEN_K: tl.constexpr, ACT: tl.constexpr, X2D: tl.constexpr,
    BLOCK_SCALE: tl.constexpr, NORM: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    """One W tile applied to each of the M rows of x (accumulators past M untouched; NORM:
    row m's x normalised with `rs<m>`, the residual rows at `r_ptrs` share x's row stride)."""
    acc0 = _fma_row(acc0, w, x_ptrs, x_mask, half, sx, r_ptrs, nw, rs0, EVEN_K, ACT, X2D,
                    BLOCK_SCALE, NORM, ADD)  # fmt: skip
    if M > 1:
        acc1 = _fma_row(
            acc1, w, x_ptrs + stride_xm, x_mask, half, sx, r_ptrs + stride_xm, nw, rs1, EVEN_K,
            ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
    if M > 2:
        acc2 = _fma_row(
            acc2, w, x_ptrs + 2 * stride_xm, x_mask, half, sx, r_ptrs + 2 * stride_xm, nw, rs2, EVEN_K,
            ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
    if M > 3:
        acc3 = _fma_row(
            acc3, w, x_ptrs + 3 * stride_xm, x_mask, half, sx, r_ptrs + 3 * stride_xm, nw, rs3, EVEN_K,
            ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
    if M > 4:
        acc4 = _fma_row(
            acc4, w, x_ptrs + 4 * stride_xm, x_mask, half, sx, r_ptrs + 4 * stride_xm, nw, rs4, EVEN_K,
            ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
    if M > 5:
        acc5 = _fma_row(
            acc5, w, x_ptrs + 5 * stride_xm, x_mask, half, sx, r_ptrs + 5 * stride_xm, nw, rs5, EVEN_K,
            ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
    if M > 6:
        acc6 = _fma_row(
            acc6, w, x_ptrs + 6 * stride_xm, x_mask, half, sx, r_ptrs + 6 * stride_xm, nw, rs6, EVEN_K,
            ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
    if M > 7:
        acc7 = _fma_row(
            acc7, w, x_ptrs + 7 * stride_xm, x_mask, half, sx, r_ptrs + 7 * stride_xm, nw, rs7, EVEN_K,
            ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
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
def _row_rstd(x_row, r_row, sum_row, K, eps, store, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """`1 / sqrt(mean(s * s) + eps)` of one row, `s = residual + x` rounded to x's dtype (ADD;
    else x), as `reference.add_rms_norm`; with ADD and `store`, `s` is written to `sum_row`."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        kk = k + offs
        mask = kk < K
        a = tl.load(x_row + kk, mask=mask, other=0.0, eviction_policy="evict_last")
        s = a.to(tl.float32)
        if ADD:
            r = tl.load(r_row + kk, mask=mask, other=0.0, eviction_policy="evict_last")
            s = (s + r.to(tl.float32)).to(a.dtype)
            if store:
                tl.store(sum_row + kk, s, mask=mask)
            s = s.to(tl.float32)
        acc += s * s
    return tl.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _norm_rstds(x_ptr, r_ptr, sum_ptr, K, eps, store, M: tl.constexpr, ADD: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    """`_row_rstd` of each of the M rows (contiguous `[M, K]` x, residual and sum); rows
    past M get 1.0, unused."""
    rs0 = _row_rstd(x_ptr, r_ptr, sum_ptr, K, eps, store, ADD, BLOCK)
    rs1, rs2, rs3, rs4, rs5, rs6, rs7 = rs0, rs0, rs0, rs0, rs0, rs0, rs0
    if M > 1:
        rs1 = _row_rstd(x_ptr + K, r_ptr + K, sum_ptr + K, K, eps, store, ADD, BLOCK)
    if M > 2:
        rs2 = _row_rstd(x_ptr + 2 * K, r_ptr + 2 * K, sum_ptr + 2 * K, K, eps, store, ADD, BLOCK)
    if M > 3:
        rs3 = _row_rstd(x_ptr + 3 * K, r_ptr + 3 * K, sum_ptr + 3 * K, K, eps, store, ADD, BLOCK)
    if M > 4:
        rs4 = _row_rstd(x_ptr + 4 * K, r_ptr + 4 * K, sum_ptr + 4 * K, K, eps, store, ADD, BLOCK)
    if M > 5:
        rs5 = _row_rstd(x_ptr + 5 * K, r_ptr + 5 * K, sum_ptr + 5 * K, K, eps, store, ADD, BLOCK)
    if M > 6:
        rs6 = _row_rstd(x_ptr + 6 * K, r_ptr + 6 * K, sum_ptr + 6 * K, K, eps, store, ADD, BLOCK)
    if M > 7:
        rs7 = _row_rstd(x_ptr + 7 * K, r_ptr + 7 * K, sum_ptr + 7 * K, K, eps, store, ADD, BLOCK)
    return rs0, rs1, rs2, rs3, rs4, rs5, rs6, rs7


@triton.jit
def _load_nw(nw_ptrs, mask, EVEN_K: tl.constexpr, NORM: tl.constexpr):
    """The tile's norm weights as float32 (NORM; else a placeholder 1.0)."""
    if NORM:
        if EVEN_K:
            nw = tl.load(nw_ptrs, eviction_policy="evict_last").to(tl.float32)
        else:
            nw = tl.load(nw_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
            nw = nw.to(tl.float32)
    else:
        nw = 1.0
    return nw


@triton.jit
def _stream_tiles(
    w_ptrs, x_ptrs, s_row_ptr, k_lo, k_hi, offs_k, x_offs, stride_xm, half,
    x_ptr, r_ptr, nw_ptr, sum_ptr, K, eps, store_sum,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, ACT: tl.constexpr, X2D: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    BI: tl.constexpr, PDL: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr = False,
    ADD: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 16,
):  # fmt: skip
    """The W tiles of K range `[k_lo, k_hi)` (and, BLOCK_SCALE, their K-column scales from
    `s_row_ptr`) applied to the M rows of x: the 8 row accumulators. The first tile is peeled
    off the loop and loaded before waiting on the previous kernel (PDL): W does not depend on
    it, so its latency hides behind that kernel's tail; once the loads are done the next
    kernel may launch. G > 0: grouped tiles `[BLOCK_N, G, BLOCK_K // G]` (the caller's
    pointers are shaped so, `offs_k` holds each group's first column, X2D).

    NORM (the add + RMSNorm fused into the projection): x is `rms_norm(residual + x)` with
    the norm weights at `nw_ptr`; after the wait each program reads the M whole rows of x
    (contiguous `[M, K]`, and the residual at `r_ptr` with ADD) once for their `rstd`, and
    the program with `store_sum` writes the rounded sums to `sum_ptr`."""
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _zero_accs(BLOCK_N, BLOCK_K, G)
    w = _load_w(w_ptrs, k_lo, offs_k, k_hi, EVEN_K)
    sx = _load_sx(s_row_ptr, k_lo, offs_k, k_hi, BLOCK_K, BI, BLOCK_SCALE)
    if PDL:
        gdc_wait()
    if NORM:
        rs0, rs1, rs2, rs3, rs4, rs5, rs6, rs7 = _norm_rstds(
            x_ptr, r_ptr, sum_ptr, K, eps, store_sum, M, ADD, NORM_BLOCK
        )
    else:
        rs0, rs1, rs2, rs3, rs4, rs5, rs6, rs7 = 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0
    if NORM:
        r_ptrs = r_ptr + k_lo + x_offs
        nw_ptrs = nw_ptr + k_lo + x_offs
    else:
        r_ptrs = x_ptrs
        nw_ptrs = x_ptrs
    x_mask = (k_lo + x_offs) < k_hi
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _apply_tile(
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptrs, x_mask, stride_xm, half, sx,
        r_ptrs, _load_nw(nw_ptrs, x_mask, EVEN_K, NORM), rs0, rs1, rs2, rs3, rs4, rs5, rs6,
        rs7, M, EVEN_K, ACT, X2D, BLOCK_SCALE, NORM, ADD,
    )  # fmt: skip
    w_ptrs += BLOCK_K
    x_ptrs += BLOCK_K
    r_ptrs += BLOCK_K
    nw_ptrs += BLOCK_K
    for k in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=STAGES):
        w = _load_w(w_ptrs, k, offs_k, k_hi, EVEN_K)
        sx = _load_sx(s_row_ptr, k, offs_k, k_hi, BLOCK_K, BI, BLOCK_SCALE)
        x_mask = (k + x_offs) < k_hi
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _apply_tile(
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, w, x_ptrs, x_mask, stride_xm, half,
            sx, r_ptrs, _load_nw(nw_ptrs, x_mask, EVEN_K, NORM), rs0, rs1, rs2, rs3, rs4, rs5,
            rs6, rs7, M, EVEN_K, ACT, X2D, BLOCK_SCALE, NORM, ADD,
        )  # fmt: skip
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        nw_ptrs += BLOCK_K
    if PDL:
        gdc_launch_dependents()
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7
