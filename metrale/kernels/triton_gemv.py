"""Triton GEMV for small-batch decode: `y = x @ W.T (+ bias)` for `x [M, K]` with M <= 8 and
a torch-Linear weight `W [N, K]`, written to stream W at full memory bandwidth; plus
`gemv_silu_mul`, the MLP down projection with SiLU-and-multiply fused into the x loads.

Owner: kernels. Computes `F.linear` (float32 accumulation); `tests/gpu/test_gemv.py` checks it
against a float32/float64 torch reference and `tools/bench_gemv.py` times it against cuBLAS.

Invariants:
- W is read exactly once per call, whatever M: each program owns `BLOCK_N` rows of W and, for
  its K range, streams `[BLOCK_N, BLOCK_K]` tiles along K (16-byte vector loads, evict-first)
  and applies every tile to all M rows of x before moving on. Rows past N are clamped onto
  row N - 1 for the loads (no mask in the hot loop) and masked at the store.
- Accumulation is float32; the bias (if any) is added in float32 and the result is rounded
  once to x's dtype. With split-K the float32 partials go to a `[split_k, M, N]` workspace
  (`torch.empty`) and a second kernel sums them in split order, so results are deterministic.
- `gemv_silu_mul(gate_up, W)` equals `gemv(silu_and_mul(gate_up), W)` bit for bit in what it
  feeds the dot: the activation is rounded to the input dtype after SiLU and after the
  multiply, as `triton_norm.silu_and_mul` (and the torch reference) round it.
- CUDA-graph capturable: no host sync, the config depends only on shapes, dtype and the SM
  count, and the only allocations are the output and the split-K workspace.
- Inputs are never written; x and W must share a dtype (bf16, fp16 or fp32), W must be
  row-major contiguous along K.
- `lora=` (a `triton_lora_epilogue.LoraEpilogue`, from the LoRA shrink of the same x) adds
  each row's multi-LoRA delta to the columns it stores (in the reduce kernel when K is
  split): the base rounded to x's dtype, plus the delta, rounded again, as the two-kernel
  form computes it. Its code is behind the `LORA` constexpr: without it both kernels
  compile to the same machine code as before it existed (sm_90 SASS compared).

Config heuristic (`default_config`, for H100/H200-class parts; only shapes, dtype, alignment and
the SM count go in):
- a tile row is 1 KiB of W: `BLOCK_K` = 512 elements for bf16/fp16, 256 for fp32, capped at
  K's next power of two; `BLOCK_N` = 16 rows when M == 1, else 8; 4 warps. Every thread then
  holds at most 128 float32 accumulator values (`M * BLOCK_N * BLOCK_K / 128 <= 128`);
- when M > 4, or when the loads cannot vectorise (K, a row stride or a base address not a
  multiple of 16 elements / bytes: scalar loads need more registers for addresses), the tile
  is halved to 8 rows of 512 B. With that, every M and dtype compiles for sm_90 without
  spills for aligned rows, and with at most two spilled scalars for unaligned ones (checked
  with ptxas);
- a 3-stage cp.async pipeline at M == 1 (two W tiles in flight per program, 34 KiB of shared
  memory), 4 stages for M > 1, so bandwidth does not hinge on how many programs fit on an SM;
- no split-K by default (measured on the H200: each split shape ran faster unsplit; the
  `split_k=0` config still picks the split described by `_split_for`, for the benchmark).
  Qwen3-8B bf16 at M == 1: qkv 384 programs, o_proj 256, gate_up 1536, down 256, lm_head
  9496; at M == 1 the projections reach 80-109% of the H200's copy bandwidth (cuBLAS 63-100%).
`candidate_configs` lists the variations `tools/bench_gemv.py` times on the device.

The device helpers that stream W and apply it to the rows (`_stream_tiles`, `_apply_tile`,
`_store_rows`) also serve `triton_fp8`'s GEMV, whose K-column block scales (`_load_sx`,
BLOCK_SCALE) and row scales (ROW_SCALE) are constexpr branches this GEMV compiles out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import (
    gdc_launch_dependents,
    gdc_wait,
    multiprocessor_count,
    pdl_options,
)
from metrale.kernels.triton_lora_epilogue import (
    LoraEpilogue,
    epilogue_args,
    lora_add_delta,
    lora_load_b,
    lora_load_bs,
    lora_store_rows,
)

#: Most rows of x one call takes (each row is a separate accumulator in every program).
MAX_M = 8
#: Float32 accumulator values one thread may hold (`M * BLOCK_N * BLOCK_K / threads`).
_ACC_BUDGET = 128


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of one GEMV (`block_n`, `block_k` powers of two). `split_k=0` means
    "the heuristic's split for these blocks"; `num_stages=1` is a plain loop, more stages a
    software pipeline through shared memory. At launch `block_k` is capped at K's next power
    of two and `split_k` at K's number of tiles."""

    block_n: int = 16
    block_k: int = 512
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3

    def describe(self) -> str:
        return (
            f"n{self.block_n}_k{self.block_k}_s{self.split_k}_w{self.num_warps}_st{self.num_stages}"
        )

    def fits(self, m: int) -> bool:
        """Whether M rows of accumulators stay within the per-thread register budget."""
        return m * self.block_n * self.block_k <= _ACC_BUDGET * 32 * self.num_warps


def _split_for(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    tiles = triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split = 1
    while tiles * split < 2 * sms and k_tiles >= 4 * (2 * split):
        split *= 2
    return split


def _resolve(config: GemvConfig, n: int, k: int, dtype: torch.dtype, sms: int) -> GemvConfig:
    """`config` made concrete for one shape: `block_k` capped (but at least one 16-byte
    vector per thread of a warp), `split_k` chosen if 0 and capped at K's tiles."""
    block_k = max(16 // dtype.itemsize, min(config.block_k, triton.next_power_of_2(max(k, 1))))
    split = config.split_k or _split_for(n, k, config.block_n, block_k, sms)
    split = max(1, min(split, triton.cdiv(k, block_k)))
    return replace(config, block_k=block_k, split_k=split)


@functools.lru_cache(maxsize=1024)
def default_config(
    m: int, n: int, k: int, dtype: torch.dtype, sms: int = 132, aligned: bool = True
) -> GemvConfig:
    """The heuristic described in the module docstring, resolved for the shape. `aligned`:
    whether the loads vectorise (see `_aligned`)."""
    row_bytes = 1024 if m <= 4 and aligned else 512
    block_n = 16 if m == 1 and aligned else 8
    # No split-K: on the H200 every split shape ran slower unsplit-faster (o_proj 11.96 ->
    # 10.45 us, down 27.12 -> 25.35 us at M = 1; bench/records/*-gemv-*.json), the second
    # (reduce) kernel costing more than the extra programs gained. M = 2 pipelines 4 stages.
    stages = 4 if m > 1 else 3
    config = GemvConfig(block_n, row_bytes // dtype.itemsize, split_k=1, num_stages=stages)
    return _resolve(config, n, k, dtype, sms)


def candidate_configs(
    m: int, n: int, k: int, dtype: torch.dtype, sms: int = 132
) -> list[GemvConfig]:
    """`default_config` first, then variations of it worth timing on a new device (stages,
    tile height/width, warps, split), resolved for the shape, deduplicated, and only those
    within the register budget for M."""
    base = default_config(m, n, k, dtype, sms)
    free = replace(base, split_k=0)
    raw = [
        base,
        replace(base, num_stages=1),
        replace(base, num_stages=2),
        replace(base, num_stages=4),
        replace(free, block_n=base.block_n * 2),
        replace(free, block_n=max(1, base.block_n // 2)),
        replace(free, block_n=base.block_n * 2, num_warps=8),
        replace(free, block_n=max(1, base.block_n // 2), block_k=base.block_k * 2),
        replace(base, split_k=1),
        replace(base, split_k=2 * base.split_k),
    ]
    out: list[GemvConfig] = []
    for config in raw:
        resolved = _resolve(config, n, k, dtype, sms)
        if resolved.fits(m) and resolved not in out:
            out.append(resolved)
    return out


# -------------------------------------------------------------------------------------------
# Kernels
# -------------------------------------------------------------------------------------------


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
def _zero_accs(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The 8 row accumulators (`[BLOCK_N, BLOCK_K]` float32 zeros; rows past M stay unused)."""
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
    BI: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The W tiles of K range `[k_lo, k_hi)` (and, BLOCK_SCALE, their K-column scales from
    `s_row_ptr`) applied to the M rows of x: the 8 row accumulators. The first tile is peeled
    off the loop and loaded before waiting on the previous kernel (PDL): W does not depend on
    it, so its latency hides behind that kernel's tail; once the loads are done the next
    kernel may launch."""
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _zero_accs(BLOCK_N, BLOCK_K)
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


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_split,
    k_per_split,
    half,
    part_ptr,
    lb_ptr,
    slots_ptr,
    scales_ptr,
    R,
    n1,
    n2,
    stride_bs,
    stride_br,
    stride_ss,
    M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    ACT: tl.constexpr,
    PDL: tl.constexpr = False,
    LORA: tl.constexpr = False,
    T: tl.constexpr = 1,
    SPLITS: tl.constexpr = 1,
    SPLITS_P2: tl.constexpr = 1,
    BLOCK_R: tl.constexpr = 16,
    BLOCK_TR: tl.constexpr = 16,
):
    """Grid `(cdiv(N, BLOCK_N), split_k)`: rows `[pid_n * BLOCK_N, +BLOCK_N)` of W over the
    K range `[pid_k * k_per_split, +k_per_split)` (`k_per_split` a multiple of BLOCK_K).

    Every row of x has a `[BLOCK_N, BLOCK_K]` float32 accumulator updated elementwise, so the
    loop body is loads and FMAs only (all of a tile's loads issue before the first FMA) and
    the cross-thread reduction runs once, at the end. STAGES == 1: a plain loop, x loaded
    in W's layout (a broadcast the compiler folds to one load per thread); STAGES > 1: the
    loop is software-pipelined, STAGES - 1 tiles of W (and x) in flight through shared
    memory (cp.async).

    PDL (programmatic dependent launch): the first W tile is loaded, then the program waits
    for the previous kernel before its first x load, and lets the next kernel launch once its
    loads are done.

    LORA (unsplit only; a split GEMV's reduce kernel adds it): each stored row gets its
    LoRA delta (`triton_lora_epilogue.lora_store_rows`: the shrink's partials at `part_ptr`,
    B at `lb_ptr`, the rows' slots and the scales; `R`, `n1`, `n2` and the strides: the
    group's rank, target bounds and B / scales strides). Each row's B tile is loaded first,
    before the PDL wait (B and the slots are no kernel's output), the partials at the end."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    X2D: tl.constexpr = STAGES == 1
    if X2D:
        x_offs = offs_k[None, :] + tl.zeros([BLOCK_N, 1], dtype=tl.int32)
    else:
        x_offs = offs_k
    x_ptrs = x_ptr + k_lo + x_offs
    if LORA and not PARTIAL:
        bv0, bv1, bv2, bv3, bv4, bv5, bv6, bv7 = lora_load_bs(
            lb_ptr, slots_ptr, offs_n, n_mask, R, stride_bs, stride_br, M, BLOCK_R
        )
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _stream_tiles(
        w_ptrs, x_ptrs, x_ptr, k_lo, k_hi, offs_k, x_offs, stride_xm, half, M, BLOCK_N, BLOCK_K,
        STAGES, EVEN_K, ACT, X2D, False, 1, PDL,
    )  # fmt: skip
    out_ptr += pid_k.to(tl.int64) * stride_split
    if LORA and not PARTIAL:
        lora_store_rows(
            out_ptr, b_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, bv0, bv1, bv2, bv3,
            bv4, bv5, bv6, bv7, offs_n, n_mask, stride_om, part_ptr, slots_ptr, scales_ptr, R,
            n1, n2, stride_ss, M, HAS_BIAS, T, SPLITS, SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK_N,
        )  # fmt: skip
    else:
        _store_rows(out_ptr, b_ptr, b_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                    offs_n, n_mask, stride_om, M, HAS_BIAS, PARTIAL, False)  # fmt: skip


@triton.jit
def _split_reduce_kernel(
    ws_ptr,
    b_ptr,
    out_ptr,
    N,
    stride_split,
    stride_wm,
    stride_om,
    part_ptr,
    lb_ptr,
    slots_ptr,
    scales_ptr,
    R,
    n1,
    n2,
    stride_bs,
    stride_br,
    stride_ss,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    LORA: tl.constexpr = False,
    T: tl.constexpr = 1,
    SPLITS: tl.constexpr = 1,
    SPLITS_P2: tl.constexpr = 1,
    BLOCK_R: tl.constexpr = 16,
    BLOCK_TR: tl.constexpr = 16,
):
    """Grid `(cdiv(N, BLOCK), M)`: out[m] = sum over splits (in order) + bias, rounded once
    (LORA: then row m's LoRA delta added, as `_gemv_kernel`'s epilogue)."""
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ptrs = ws_ptr + m * stride_wm + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * stride_split, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LORA:
        bv = lora_load_b(lb_ptr, slots_ptr, m, offs, mask, R, stride_bs, stride_br, BLOCK_R)
        out = lora_add_delta(
            acc, out_ptr.dtype.element_ty, bv, part_ptr, slots_ptr, scales_ptr, m, offs, R, n1,
            n2, stride_ss, T, SPLITS, SPLITS_P2, BLOCK_R, BLOCK_TR, BLOCK,
        )  # fmt: skip
        tl.store(out_ptr + m * stride_om + offs, out, mask=mask)
    else:
        tl.store(out_ptr + m * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# -------------------------------------------------------------------------------------------
# Launchers
# -------------------------------------------------------------------------------------------


def _aligned(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """Whether Triton will see every address of the loads as 16-byte aligned (it specialises
    integer arguments divisible by 16 and 16-byte-aligned pointers), so they vectorise."""
    return all(v % 16 == 0 for v in (k, x.stride(0), weight.stride(0))) and all(
        t.data_ptr() % 16 == 0 for t in (x, weight)
    )


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    act: bool,
    config: GemvConfig | None,
    pdl: bool = False,
    lora: LoraEpilogue | None = None,
) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"gemv: bad shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    m, n = x.shape[0], weight.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv takes 1..{MAX_M} rows, got {m}")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"gemv: x {x.dtype} and weight {weight.dtype} must share a float dtype")
    if weight.stride(1) != 1 and k > 1:
        raise ValueError("gemv: the weight must be contiguous along K (torch Linear layout)")
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if lora is not None and k == 0:
        raise ValueError("gemv: a LoRA epilogue needs K > 0")
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias.to(out.dtype)
        return out
    sms = multiprocessor_count(x.device)
    if config is None:
        cfg = default_config(m, n, k, x.dtype, sms, _aligned(x, weight, k))
    else:
        cfg = _resolve(config, n, k, x.dtype, sms)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    partial = split > 1
    dest = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if partial else out
    grid = (triton.cdiv(n, cfg.block_n), split)
    lora_args = epilogue_args(lora, m, n, out)  # checked; placeholders without an epilogue
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else out,
        dest,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        n,
        m * n,
        k_per_split,
        k,
        **(epilogue_args(None, m, n, out) if partial else lora_args),
        M=m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        STAGES=cfg.num_stages,
        EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None and not partial,
        PARTIAL=partial,
        ACT=act,
        PDL=pdl and not partial,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(pdl and not partial),
    )
    if partial:
        # a LoRA epilogue holds a [rank, BLOCK] tile of B: 256 columns keep it at 32 a thread
        block = min(1024 if lora is None else 256, triton.next_power_of_2(n))
        _split_reduce_kernel[(triton.cdiv(n, block), m)](
            dest,
            bias if bias is not None else out,
            out,
            n,
            m * n,
            n,
            n,
            **lora_args,
            SPLIT_K=split,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    pdl: bool = False,
    lora: LoraEpilogue | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for `x [M, K]` (1 <= M <= 8) and `weight [N, K]`, float32
    accumulation, result `[M, N]` in x's dtype. `config` overrides `default_config`; `pdl`
    launches it as a programmatic dependent of the previous kernel (sm_90+); `lora` (from
    `triton_lora_epilogue.lora_shrink` of this x) adds each row's LoRA delta as it stores."""
    return _launch(x, weight, bias, x.shape[-1], False, config, pdl, lora)


def gemv_silu_mul(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemvConfig | None = None,
    pdl: bool = False,
    lora: LoraEpilogue | None = None,
) -> torch.Tensor:
    """`gemv(silu_and_mul(gate_up), weight, bias)` for `gate_up [M, 2I]` (gate then up) and
    `weight [N, I]`, the activation computed while loading x (never written to memory);
    `lora` from `lora_shrink(gate_up, ..., act=True)`."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gemv_silu_mul: odd gate/up width {gate_up.shape[-1]}")
    return _launch(gate_up, weight, bias, gate_up.shape[-1] // 2, True, config, pdl, lora)
