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

The launch configuration (`GemvConfig`, the `default_config` heuristic and the
`candidate_configs` the benchmark times) is in `triton_gemv_config`, re-exported here.

The device helpers that stream W and apply it to the rows (`_stream_tiles`, `_store_rows`)
are in `triton_gemv_tiles`, shared with `triton_fp8`'s GEMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import multiprocessor_count, pdl_options
from metrale.kernels.triton_gemv_config import (  # noqa: F401 (re-exported)
    MAX_M,
    GemvConfig,
    _resolve,
    _split_for,
    candidate_configs,
    default_config,
)
from metrale.kernels.triton_gemv_tiles import _store_rows, _stream_tiles
from metrale.kernels.triton_lora_epilogue import (
    LoraEpilogue,
    epilogue_args,
    lora_add_delta,
    lora_load_b,
    lora_load_bs,
    lora_store_rows,
)

# -------------------------------------------------------------------------------------------
# Kernels
# -------------------------------------------------------------------------------------------


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
        STAGES, EVEN_K, ACT, X2D, False, 1, PDL, 0,
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
