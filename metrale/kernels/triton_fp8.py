"""FP8 (E4M3) weight projections on CUDA: `y = x @ dequantize(W).T (+ bias)` with W stored as
`float8_e4m3fn [N, K]` and its float32 scales (one per `block` of W, or one per output row),
x in bf16 / fp16 / fp32. A GEMV for decode batches (few rows) and a W8A16 GEMM for the rest;
`linear_fp8` / `silu_mul_linear_fp8` are the CUDA entries of the `KernelOps` ops of the same
names and compute `reference.linear_fp8` / `reference.silu_mul_linear_fp8`.

Owner: kernels. `tests/gpu/test_fp8_linear.py` checks both kernels against the reference.

Invariants:
- Scales: `block` `(bo, bi)` -> `scale [cdiv(N, bo), cdiv(K, bi)]`, W's element `(n, k)`
  weighs `scale[n // bo, k // bi]`; `block` None -> `scale [N]` per output row. Activations
  are never quantized (W8A16): the weight tile is converted exactly (every E4M3 value is a
  bf16 value) and the products accumulate in float32.
- GEMV (`gemv_fp8`, at most `FP8_GEMV_MAX_ROWS` rows): the design of `triton_gemv` (W read
  once, `[BLOCK_N, BLOCK_K]` tiles streamed along K evict-first and applied to all M rows,
  elementwise float32 accumulators reduced once, first tile loaded before the PDL wait). A
  block scale is folded into x (`x[k] * scale[row block, k // bi]`, exact in float32 up to
  one rounding per product) because every program's `BLOCK_N` rows lie in one row block
  (`BLOCK_N` divides `bo`); a row scale multiplies the reduced sum. With block scales and K
  a multiple of the tile, the tile is grouped (`[BLOCK_N, G, BLOCK_K // G]`, each group of
  columns inside one column block), so a thread loads one scale per tile instead of one per
  column. `gemv_fp8_silu_mul` computes SiLU-and-multiply while loading x, rounded as
  `triton_norm.silu_and_mul` rounds.
- GEMM (`gemm_fp8`, up to `GEMM_MAX_ROWS_BLOCK` / `GEMM_MAX_ROWS_ROW` rows): the output
  tile computed transposed, `tl.dot` of the converted W tile `[BLOCK_N, BLOCK_K]` with the x
  tile transposed, per K step, accumulated in the dot. With block scales the W tile is
  `(fp8 * scale)` rounded to x's dtype, the reference's own weight (`BLOCK_N` divides `bo`,
  `BLOCK_K` divides `bi`); with row scales the sum is scaled once at the end. float32 x uses
  IEEE (not TF32) dots. Beyond those rows, `dequantize` writes the reference's weight in x's
  dtype (one kernel) and cuBLAS multiplies: the reference computation itself, and faster
  there than the W8A16 GEMM, whose in-loop conversion keeps it below cuBLAS bf16.
- No host sync, no allocation but the output (and, beyond the GEMM's rows, the dequantized
  weight): CUDA-graph capturable. The choice of kernel and its config depend only on
  shapes, dtypes and the block.
- Block sizes must be powers of two >= 16 (`reference.fp8_block_supported`); the start-up
  (`model_engine/fp8_weights.py`) keeps other layouts dequantized (logged) instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from metrale.kernels.reference import fp8_block_supported as block_supported
from metrale.kernels.triton_attention_common import pdl_options
from metrale.kernels.triton_gemv_tiles import _store_rows, _stream_tiles
from metrale.kernels.triton_norm import silu_and_mul

#: Most rows sent to the FP8 GEMV (its register budget allows 8; with the weight stream
#: halved the GEMV's one pass over W pays for more rows than in bf16 — unmeasured, see
#: KERNELS.md).
FP8_GEMV_MAX_ROWS = 8
_ACC_BUDGET = 128 * 32 * 4


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"fp8 linear: bad shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    _check_weight(weight, scale, x.dtype)


def _check_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
    """The FP8 weight and its scales, for activations (or a dequantized weight) of `dtype`."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8 linear: weight is {weight.dtype}, expected float8_e4m3fn")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"fp8 linear: activations are {dtype}")
    if scale.dtype != torch.float32 or not scale.is_contiguous():
        raise TypeError("fp8 linear: the scale must be a contiguous float32 tensor")
    if weight.stride(1) != 1:
        raise ValueError("fp8 linear: the weight must be contiguous along K")


def _row_block(block: tuple[int, int] | None, n: int) -> int:
    """Largest power of two <= n dividing the row block (the whole tile for row scales)."""
    bo = block[0] if block is not None else n
    while bo % n:
        n //= 2
    return n


# -------------------------------------------------------------------------------------------
# GEMV
# -------------------------------------------------------------------------------------------


@triton.jit
def _gemv_fp8_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_om, half,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_SCALE: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, G: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid `(cdiv(N, BLOCK_N),)`: rows `[pid * BLOCK_N, +BLOCK_N)` of W over all of K. G > 0
    (block scales, K a multiple of BLOCK_K): tiles `[BLOCK_N, G, BLOCK_K // G]` whose groups
    of columns each lie in one column block, so each thread loads its group's one scale."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if G > 0:
        GROUP: tl.constexpr = BLOCK_K // G
        offs_g = tl.arange(0, G)
        offs_i = tl.max_contiguous(tl.multiple_of(tl.arange(0, GROUP), GROUP), GROUP)
        x_offs = (offs_g[:, None] * GROUP + offs_i[None, :])[None, :, :]
        w_ptrs = w_ptr + rows[:, None, None] * stride_wn + x_offs
        offs_k = (offs_g * GROUP)[None, :, None]
    else:
        offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
        x_offs = offs_k
        w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + x_offs
    # BLOCK_N divides BO: the program's rows share one row block of scales.
    s_row_ptr = s_ptr + ((pid_n * BLOCK_N) // BO).to(tl.int64) * stride_sn
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _stream_tiles(
        w_ptrs, x_ptrs, s_row_ptr, 0, K, offs_k, x_offs, stride_xm, half, M, BLOCK_N, BLOCK_K,
        STAGES, EVEN_K, ACT, G > 0, BLOCK_SCALE, BI, PDL, G,
    )  # fmt: skip
    if G > 0:  # each group's partial sums (rows past M are never stored)
        acc0, acc1, acc2, acc3 = tl.sum(acc0, 2), tl.sum(acc1, 2), tl.sum(acc2, 2), tl.sum(acc3, 2)
        acc4, acc5, acc6, acc7 = tl.sum(acc4, 2), tl.sum(acc5, 2), tl.sum(acc6, 2), tl.sum(acc7, 2)
    _store_rows(out_ptr, b_ptr, s_ptr, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, offs_n,
                n_mask, stride_om, M, HAS_BIAS, False, not BLOCK_SCALE)  # fmt: skip


def gemv_config(m: int, k: int, block: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """`(BLOCK_N, BLOCK_K, stages, G)`: tile rows of 512 fp8 bytes (one 16-byte vector per
    thread of a warp, the bf16 GEMV's register shape at half its bytes), 16 rows at M == 1
    else 8, halved K until M rows of accumulators fit the register budget; 5 cp.async stages
    (at M == 1 four 8 KiB tiles in flight per program: the bf16 GEMV's 32 KiB with half-size
    tiles). BLOCK_N divides the row block.

    Block scales: BLOCK_K is also halved until it divides K (not below 16), and the tile is
    grouped, `G = BLOCK_K // min(BLOCK_K, bi)` groups of columns each inside one column
    block (G = 0, the flat tile with a per-column scale gather, only when K is not a multiple
    of 16). On the H200 at M == 1 the grouped tile took 9.7 / 7.8 / 29.1 / 15.7 us on the
    Qwen3-8B qkv / o_proj / gate_up / down shapes with 128 x 128 blocks
    (`bench/records/20261202T135054-fp8-kernels-qwen3-8b.json`), against 16.0 / 11.5 / 57.7 /
    29.4 us with the gather (`…T003701-fp8-kernels…`)."""
    block_n = _row_block(block, 16 if m == 1 else 8)
    block_k = min(512, max(16, triton.next_power_of_2(max(k, 1))))
    while m * block_n * block_k > _ACC_BUDGET and block_k > 16:
        block_k //= 2
    if block is None:
        return block_n, block_k, 5, 0
    while k % block_k and block_k > 16:
        block_k //= 2
    if k % block_k:
        return block_n, block_k, 5, 0
    return block_n, block_k, 5, block_k // min(block_k, block[1])


def _gemv_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int] | None,
    k: int,
    act: bool,
    pdl: bool,
) -> torch.Tensor:
    _check(x, weight, scale, k)
    m, n = x.shape[0], weight.shape[0]
    if not 1 <= m <= FP8_GEMV_MAX_ROWS:
        raise ValueError(f"gemv_fp8 takes 1..{FP8_GEMV_MAX_ROWS} rows, got {m}")
    if not block_supported(block):
        raise ValueError(f"gemv_fp8: block {block} is not powers of two >= 16")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n, block_k, stages, groups = gemv_config(m, k, block)
    _gemv_fp8_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, bias if bias is not None else out, out, n, k, x.stride(0),
        weight.stride(0), scale.stride(0) if block is not None else 0, n, k,
        M=m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, EVEN_K=k % block_k == 0,
        HAS_BIAS=bias is not None, ACT=act, BLOCK_SCALE=block is not None,
        BO=block[0] if block is not None else block_n, BI=block[1] if block is not None else 1,
        G=groups, PDL=pdl, num_warps=4, num_stages=stages, **pdl_options(pdl),
    )  # fmt: skip
    return out


def gemv_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None, *, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`reference.linear_fp8` for `x [M, K]` with 1 <= M <= 8."""
    return _gemv_launch(x, weight, scale, bias, block, x.shape[-1], False, pdl)


def gemv_fp8_silu_mul(
    gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    bias: torch.Tensor | None = None, block: tuple[int, int] | None = None, *, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`gemv_fp8(silu_and_mul(gate_up), ...)`, the activation computed while loading x."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gemv_fp8_silu_mul: odd gate/up width {gate_up.shape[-1]}")
    return _gemv_launch(gate_up, weight, scale, bias, block, gate_up.shape[-1] // 2, True, pdl)


# -------------------------------------------------------------------------------------------
# GEMM (W8A16)
# -------------------------------------------------------------------------------------------


@triton.jit
def _gemm_fp8_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_SCALE: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))`: the output tile `[BLOCK_M, BLOCK_N]`
    computed transposed, `W_tile @ x_tile^T` (the converted weight is the dot's first operand,
    the few rows of x its narrow second one: the shape the tensor cores take from 64 weight
    rows and as few as 16 tokens)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    xt_ptrs = x_ptr + rows_m[None, :] * stride_xm + offs_k[:, None]
    w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    s_row_ptr = s_ptr + ((pid_n * BLOCK_N) // BO).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_mask = (k + offs_k) < K
        xt = tl.load(xt_ptrs + k, mask=k_mask[:, None], other=0.0)
        w = tl.load(w_ptrs + k, mask=k_mask[None, :], other=0.0)
        if BLOCK_SCALE:  # the reference's weight: fp8 * its block scale, rounded to x's dtype
            a = (w.to(tl.float32) * tl.load(s_row_ptr + k // BI)).to(xt.dtype)
        else:
            a = w.to(xt.dtype)
        if IEEE:
            acc = tl.dot(a, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, xt, acc)
    if not BLOCK_SCALE:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


#: Most rows the Triton GEMM takes with block scales / per-row scales; beyond, the weight is
#: dequantized (`dequantize`) and multiplied by cuBLAS. Chosen from a scratch sweep on the
#: H200 (2026-12-02, not a record; Qwen3-8B shapes, 128 x 128 blocks): at 256 rows
#: dequantize + cuBLAS took 44 / 30 / 150 / 86 us (qkv / o_proj / gate_up / down) against
#: the Triton GEMM's 49 / 35 / 144 / 99; with row scales the GEMM still won at 256 rows
#: (43 / 29 / 126 / 82) and lost at 512. The committed record of the chosen paths is
#: `bench/records/20261202T135054-fp8-kernels-qwen3-8b.json` (16, 64, 128, 512, 4096 rows).
GEMM_MAX_ROWS_BLOCK = 128
GEMM_MAX_ROWS_ROW = 256


def gemm_config(
    m: int, block: tuple[int, int] | None, itemsize: int = 2
) -> tuple[int, int, int, int, int]:
    """`(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`: 64 weight rows a program (more programs
    than SMs on every projection), BLOCK_M 16 / 32 / 64 / 128 tokens by M, BLOCK_K 128 (within
    one column block), 4 warps, 4 stages (3 at 128 tokens). float32 x (IEEE dots on CUDA
    cores, a test and reference path) at most 32 tokens x 32 columns. BLOCK_N divides the
    row block and BLOCK_K the column block."""
    wide = itemsize <= 2
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 128 else 128
    block_m = block_m if wide else min(block_m, 32)
    block_n = _row_block(block, 64)
    widest = 128 if wide else 32
    block_k = min(widest, block[1]) if block is not None else widest
    return block_m, block_n, block_k, 4, 3 if block_m == 128 else 4


def gemm_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`reference.linear_fp8` for `x [M, K]`, any M (the many-row path): the Triton GEMM up to
    `GEMM_MAX_ROWS_*` rows, else `dequantize` then cuBLAS (the reference's own computation)."""
    k = x.shape[-1]
    _check(x, weight, scale, k)
    if not block_supported(block):
        raise ValueError(f"gemm_fp8: block {block} is not powers of two >= 16")
    m, n = x.shape[0], weight.shape[0]
    if m > (GEMM_MAX_ROWS_BLOCK if block is not None else GEMM_MAX_ROWS_ROW):
        return F.linear(x, dequantize(weight, scale, block, x.dtype), bias)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, warps, stages = gemm_config(m, block, x.element_size())
    _gemm_fp8_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, weight, scale, bias if bias is not None else out, out, m, n, k, x.stride(0),
        weight.stride(0), scale.stride(0) if block is not None else 0, n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages,
        HAS_BIAS=bias is not None, BLOCK_SCALE=block is not None,
        BO=block[0] if block is not None else block_n, BI=block[1] if block is not None else 1,
        IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------
# Dequantize (the many-row path: the reference's weight, then cuBLAS)
# -------------------------------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALE: tl.constexpr,
    BO: tl.constexpr, BI: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))`: `out = (w * scale)` rounded once to the
    output dtype, the product in float32 (`reference.dequantize_fp8(...).to(dtype)`)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    if BLOCK_SCALE:
        s = tl.load(s_ptr + (offs_n // BO).to(tl.int64)[:, None] * stride_sn
                    + (offs_k // BI)[None, :], mask=mask, other=0.0)  # fmt: skip
    else:
        s = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[:, None]
    out = w.to(tl.float32) * s
    tl.store(out_ptr + rows * stride_on + offs_k[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """`reference.dequantize_fp8(weight, scale, block).to(dtype)` in one kernel."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 dequantize: bad weight shape {tuple(weight.shape)}")
    _check_weight(weight, scale, dtype)
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    if n == 0 or k == 0:
        return out
    _dequantize_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](
        weight, scale, out, n, k, weight.stride(0), scale.stride(0) if block is not None else 0,
        out.stride(0), BLOCK_N=32, BLOCK_K=256, BLOCK_SCALE=block is not None,
        BO=block[0] if block is not None else 1, BI=block[1] if block is not None else 1,
        num_warps=4,
    )  # fmt: skip
    return out


# -------------------------------------------------------------------------------------------
# KernelOps entries
# -------------------------------------------------------------------------------------------


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None, *, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`KernelOps.linear_fp8`: the GEMV for 1..`FP8_GEMV_MAX_ROWS` rows, else the GEMM
    (`pdl` applies to the GEMV only)."""
    flat = _flat(x)
    if 0 < flat.shape[0] <= FP8_GEMV_MAX_ROWS:
        out = gemv_fp8(flat, weight, scale, bias, block, pdl=pdl)
    else:
        out = gemm_fp8(flat, weight, scale, bias, block)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def silu_mul_linear_fp8(
    gate_up: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
    bias: torch.Tensor | None = None, block: tuple[int, int] | None = None, *, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`KernelOps.silu_mul_linear_fp8`: the fused GEMV for few rows; else `silu_and_mul`
    (Triton) then the GEMM."""
    flat = _flat(gate_up)
    if 0 < flat.shape[0] <= FP8_GEMV_MAX_ROWS:
        out = gemv_fp8_silu_mul(flat, weight, scale, bias, block, pdl=pdl)
    else:
        out = gemm_fp8(silu_and_mul(flat), weight, scale, bias, block)
    return out.reshape(*gate_up.shape[:-1], weight.shape[0])
