"""Fused mixture-of-experts on CUDA: `moe_experts`, `moe_softmax_topk` and
`moe_softmax_experts`, the Triton forms of the `ssm_reference` ops of the same names (the
torch references the CPU keeps), with no host sync, so a decode step of an MoE model is
captured in the decode CUDA graphs.

Owner: kernels. They are the CUDA entries of the `KernelOps` fields of the same names
(`triton_ops.TRITON_OPS`); `tests/gpu/test_moe_kernels.py` checks them against the
references.

Two paths, chosen from static shapes only (`use_gemv`: the assignment count `A = T * top_k`
against the expert count), so a captured graph always replays the path it captured:

- **Gathered GEMV** (decode, `A <= min(GEMV_MAX_ASSIGNMENTS, E)`): one program per (assignment,
  tile of output rows) reads only the chosen expert's rows of `w_in` (the gate and up rows of
  the same intermediate features together), applies the activation and writes the
  intermediate `[A, I]`; a second kernel streams the chosen expert's `w_out` rows over it.
  Weight bytes read per step are the routed experts' alone (the roofline); accumulation is
  float32 elementwise over `[BLOCK_N, BLOCK_K]` tiles with one reduction at the end, as in
  `triton_gemv`.
- **Grouped GEMM** (prefill and larger batches): assignments are sorted by expert on the
  device into a padded layout of fixed worst-case size (`A + E * (BLOCK_M - 1)` rows rounded
  to BLOCK_M, each block of BLOCK_M rows owned by one expert, padding rows marked invalid) by
  torch ops of static shapes (scatter-add counts, cumsum, stable argsort, searchsorted: no
  `.item()`, no `bincount`, which syncs on CUDA); then a `tl.dot` kernel for gate/up with
  the activation fused and one for down, each block reading its expert's weights once.

Softmax routing (`moe_softmax_topk`: softmax, top-k, renormalisation, cast) is one kernel,
one program per token row (`triton_moe_routing`, re-exported here). `moe_softmax_experts` (routing + experts from the router logits)
fuses it into the GEMV's gate/up kernel: each program recomputes its token's top-k from the
logits row, and the programs of column 0 store the expert ids and weights the down and
combine kernels read.

Both expert paths end in one combine kernel: `out[t] = sum_j weight[t, j] * y[t * k + j]`,
in float32, in j order (deterministic, no atomics), rounded once to x's dtype.

Invariants:
- Numerics follow the reference's rounding points: the gate/up (or up) projection is
  rounded to x's dtype, the activation rounded, the product with up rounded, the down
  projection rounded; only the routing-weighted sum is kept in float32 (the reference adds
  in the output dtype). Float32 inputs use exact (`ieee`) dots, not tf32.
- No host read of routing data: every launch shape and every buffer size depends only on
  `T`, `top_k`, `E` and the weight shapes. Buffers come from `torch.empty` (the graph pool
  under capture). The assignment count `A` is not specialised on (`do_not_specialize`), so
  a new batch size never recompiles a kernel.
- With `pdl` every kernel waits for its predecessor before its first memory access (the
  expert weights a program reads depend on the routing the previous kernel wrote, so nothing
  is prefetched across the wait); the decode graphs launch them so (`PDL_OPS`).
- Inputs are never written; x, w_in and w_out share a float dtype (bf16, fp16, fp32); the
  routing weights may be float32 or x's dtype; an unknown activation is a `ValueError`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import (
    ACTIVATIONS,
    _activate,
    _dot,
    interpreting,
    pdl_enter,
    pdl_options,
)
from metrale.kernels.triton_moe_routing import _route_row, moe_softmax_topk

#: Most assignments (`tokens * top_k`) the gathered GEMV takes; above it (or above the expert
#: count, where assignments start to share experts and a GEMV would read an expert once per
#: assignment) the grouped GEMM reads each routed expert once per block of rows.
GEMV_MAX_ASSIGNMENTS = 64


def use_gemv(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `tokens` rows take the gathered GEMV (else the grouped GEMM)."""
    return tokens * top_k <= min(GEMV_MAX_ASSIGNMENTS, num_experts)


# -------------------------------------------------------------------------------------------
# Device helpers
# -------------------------------------------------------------------------------------------


@triton.jit
def _finish_up(acc_g, acc_u, dtype: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr):
    """Projection sums (float32) -> the intermediate in `dtype`, rounded as the reference:
    the projection, the activation and (gated) the product with up each rounded."""
    g = acc_g.to(dtype).to(tl.float32)
    h = _activate(g, ACT).to(dtype)
    if GATED:
        u = acc_u.to(dtype).to(tl.float32)
        h = (h.to(tl.float32) * u).to(dtype)
    return h


@triton.jit
def _feature_tile(N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program's output features `[pid1 * BLOCK_N, +BLOCK_N)`: `(offsets, mask, their rows
    clamped below N as int64, the K offsets [BLOCK_K])`."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    return offs_n, n_mask, rows, offs_k


@triton.jit
def _block_expert(block_expert_ptr, PDL: tl.constexpr):
    """A grouped program's block `pid0` (after the PDL wait) and the expert owning it (E or
    more: a padding block)."""
    pdl_enter(PDL)
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b)
    return b, e


@triton.jit
def _block_rows(sorted_ptr, b, A, BLOCK_M: tl.constexpr):
    """Block `b`'s sorted rows: `(row offsets, their assignments, valid)` (a padding row holds
    `A`, not valid)."""
    offs_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ptr + offs_m)
    return offs_m, assign, assign < A


# -------------------------------------------------------------------------------------------
# Gathered GEMV (small batches)
# -------------------------------------------------------------------------------------------


@triton.jit
def _gemv_up_kernel(
    x_ptr, w_ptr, ids_ptr, h_ptr, logits_ptr, weights_ptr,
    INTER, K, stride_x, stride_we, stride_wr, stride_h, E, stride_l,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, STAGES: tl.constexpr,
    ROUTE: tl.constexpr = False, BLOCK_E: tl.constexpr = 1, BLOCK_TK: tl.constexpr = 1,
    RENORM: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid `(A, cdiv(INTER, BLOCK_N))`: intermediate features `[pid1 * BLOCK_N, +BLOCK_N)` of
    assignment `pid0` (token `pid0 // TOPK`), from its expert's gate rows (and the up rows
    `INTER` further down `w_in[e]`). ROUTE: the expert comes from the router logits
    (`_route_row` of the token, its slot `pid0 % TOPK`), and the programs of column 0 store
    it and its weight to `ids` / `weights` for the down and combine kernels."""
    pdl_enter(PDL)
    a = tl.program_id(0)
    if ROUTE:
        chosen_ids, chosen = _route_row(
            logits_ptr, a // TOPK, E, stride_l, TOPK, BLOCK_E, BLOCK_TK, RENORM
        )
        slot = tl.arange(0, BLOCK_TK) == a % TOPK
        e = tl.sum(tl.where(slot, chosen_ids, 0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + a, e)
            weight = tl.sum(tl.where(slot, chosen, 0.0), axis=0)
            tl.store(weights_ptr + a, weight.to(weights_ptr.dtype.element_ty))
    else:
        e = tl.load(ids_ptr + a).to(tl.int64)
    offs_n, n_mask, rows, offs_k = _feature_tile(INTER, BLOCK_N, BLOCK_K)
    w_g = w_ptr + e * stride_we + rows[:, None] * stride_wr + offs_k[None, :]
    x_row = x_ptr + (a // TOPK).to(tl.int64) * stride_x + offs_k
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_off = INTER * stride_wr
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            xk = tl.load(x_row + k, eviction_policy="evict_last").to(tl.float32)
            wg = tl.load(w_g + k, eviction_policy="evict_first").to(tl.float32)
            if GATED:
                wu = tl.load(w_g + up_off + k, eviction_policy="evict_first").to(tl.float32)
        else:
            k_mask = (k + offs_k) < K
            xk = tl.load(x_row + k, mask=k_mask, other=0.0).to(tl.float32)
            wg = tl.load(w_g + k, mask=k_mask[None, :], other=0.0).to(tl.float32)
            if GATED:
                wu = tl.load(w_g + up_off + k, mask=k_mask[None, :], other=0.0).to(tl.float32)
        acc_g += wg * xk[None, :]
        if GATED:
            acc_u += wu * xk[None, :]
    h = _finish_up(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), h_ptr.dtype.element_ty, ACT,
                   GATED)  # fmt: skip
    tl.store(h_ptr + a.to(tl.int64) * stride_h + offs_n, h, mask=n_mask)


@triton.jit
def _gemv_down_kernel(
    h_ptr, w_ptr, ids_ptr, y_ptr,
    N, K, stride_h, stride_we, stride_wr, stride_y,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid `(A, cdiv(H, BLOCK_N))`: output features `[pid1 * BLOCK_N, +BLOCK_N)` of
    assignment `pid0` through its expert's `w_out`, rounded to the dtype, unweighted."""
    pdl_enter(PDL)
    a = tl.program_id(0)
    e = tl.load(ids_ptr + a).to(tl.int64)
    offs_n, n_mask, rows, offs_k = _feature_tile(N, BLOCK_N, BLOCK_K)
    w_rows = w_ptr + e * stride_we + rows[:, None] * stride_wr + offs_k[None, :]
    h_row = h_ptr + a.to(tl.int64) * stride_h + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            hk = tl.load(h_row + k, eviction_policy="evict_last").to(tl.float32)
            w = tl.load(w_rows + k, eviction_policy="evict_first").to(tl.float32)
        else:
            k_mask = (k + offs_k) < K
            hk = tl.load(h_row + k, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + k, mask=k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * hk[None, :]
    y = tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + a.to(tl.int64) * stride_y + offs_n, y, mask=n_mask)


# -------------------------------------------------------------------------------------------
# Grouped GEMM (large batches)
# -------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["A"])
def _grouped_up_kernel(
    x_ptr, w_ptr, sorted_ptr, block_expert_ptr, h_ptr,
    A, E, INTER, K, stride_x, stride_we, stride_wr, stride_h,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GATED: tl.constexpr, ACT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid `(blocks, cdiv(INTER, BLOCK_N))`: the BLOCK_M sorted rows of block `pid0` (one
    expert's; rows past its assignments hold `A` and load zeros) times that expert's gate
    (and up) rows, activation fused; written to rows `pid0 * BLOCK_M ..` of `h`."""
    b, e = _block_expert(block_expert_ptr, PDL)
    if e >= E:
        return
    offs_m, assign, valid = _block_rows(sorted_ptr, b, A, BLOCK_M)
    tok = (tl.minimum(assign, A - 1) // TOPK).to(tl.int64)
    offs_n, n_mask, rows, offs_k = _feature_tile(INTER, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
    w_g = w_ptr + e.to(tl.int64) * stride_we + rows[None, :] * stride_wr + offs_k[:, None]
    up_off = INTER * stride_wr
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        xt = tl.load(x_ptrs + k, mask=valid[:, None] & k_mask[None, :], other=0.0)
        wg = tl.load(w_g + k, mask=k_mask[:, None], other=0.0)
        acc_g += _dot(xt, wg, UPCAST, IEEE)
        if GATED:
            wu = tl.load(w_g + up_off + k, mask=k_mask[:, None], other=0.0)
            acc_u += _dot(xt, wu, UPCAST, IEEE)
    h = _finish_up(acc_g, acc_u, h_ptr.dtype.element_ty, ACT, GATED)
    out = h_ptr + offs_m.to(tl.int64)[:, None] * stride_h + offs_n[None, :]
    tl.store(out, h, mask=n_mask[None, :])


@triton.jit(do_not_specialize=["A"])
def _grouped_down_kernel(
    h_ptr, w_ptr, sorted_ptr, block_expert_ptr, y_ptr,
    A, E, N, K, stride_h, stride_we, stride_wr, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid `(blocks, cdiv(H, BLOCK_N))`: block `pid0`'s intermediate rows times its expert's
    `w_out` rows, rounded to the dtype and scattered to the rows of their assignments in `y`
    (padding rows are not written)."""
    b, e = _block_expert(block_expert_ptr, PDL)
    if e >= E:
        return
    offs_m, assign, valid = _block_rows(sorted_ptr, b, A, BLOCK_M)
    offs_n, n_mask, rows, offs_k = _feature_tile(N, BLOCK_N, BLOCK_K)
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_h + offs_k[None, :]
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + rows[None, :] * stride_wr + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        ht = tl.load(h_ptrs + k, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k, mask=k_mask[:, None], other=0.0)
        acc += _dot(ht, w, UPCAST, IEEE)
    y = acc.to(y_ptr.dtype.element_ty)
    out = y_ptr + assign.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    tl.store(out, y, mask=valid[:, None] & n_mask[None, :])


# -------------------------------------------------------------------------------------------
# Combine
# -------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    y_ptr, weights_ptr, out_ptr, N, stride_y, stride_o,
    TOPK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid `(T, cdiv(H, BLOCK))`: `out[t] = sum_j weights[t, j] * y[t * TOPK + j]`, float32
    in j order, rounded once."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        a = t * TOPK + j
        w = tl.load(weights_ptr + a).to(tl.float32)
        yv = tl.load(y_ptr + a.to(tl.int64) * stride_y + offs, mask=mask, other=0.0)
        acc += w * yv.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty),
             mask=mask)  # fmt: skip


# -------------------------------------------------------------------------------------------
# Launchers
# -------------------------------------------------------------------------------------------


def _gemv_blocks(dtype: torch.dtype, gated: bool, k: int) -> tuple[int, int]:
    """`(BLOCK_N, BLOCK_K)` of a GEMV program. BLOCK_K: at most 1 KiB of a weight row for
    16-bit types (512 B for float32), the largest such power of two dividing K when one of at
    least 256 B does (no masked tail: Qwen3-30B-A3B's experts are 768 wide), capped at K's
    next power of two. BLOCK_N: as many rows as keep the tile at 8192 elements (4096 per
    projection when gate and up are both live), so a thread holds at most 64 float32
    accumulator values per projection."""
    cap = 512 if dtype.itemsize == 2 else 128
    block_k = cap
    while block_k * dtype.itemsize > 256 and k % block_k:
        block_k //= 2
    if k % block_k:
        block_k = cap
    block_k = max(16 // dtype.itemsize, min(block_k, triton.next_power_of_2(max(k, 1))))
    budget = 4096 if gated else 8192
    return max(1, min(64, budget // block_k)), block_k


def _grouped_blocks(dtype: torch.dtype, assignments: int, experts: int) -> tuple[int, int, int]:
    """`(BLOCK_M, BLOCK_N, BLOCK_K)` of the grouped GEMM: BLOCK_M grows with the mean rows per
    expert (16..64: less padding at mid batches, more reuse of each weight tile in
    prefill); float32 takes smaller tiles (exact dots)."""
    block_m = min(64, max(16, triton.next_power_of_2(max(1, assignments // experts))))
    if dtype == torch.float32:
        return block_m, 32, 32
    return block_m, 64, 64


def _check(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, gated: bool, activation: str,
) -> int:  # fmt: skip
    """Validate the operands; the activation's code."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"moe_experts: unsupported activation '{activation}' (have {sorted(ACTIVATIONS)})"
        )
    if x.dim() != 2 or w_in.dim() != 3 or w_out.dim() != 3:
        raise ValueError(
            f"moe_experts: bad shapes x {tuple(x.shape)}, w_in {tuple(w_in.shape)}, "
            f"w_out {tuple(w_out.shape)}"
        )
    experts, rows, hidden = w_in.shape
    inter = w_out.shape[2]
    if hidden != x.shape[1] or w_out.shape[:2] != (experts, hidden):
        raise ValueError(
            f"moe_experts: x {tuple(x.shape)}, w_in {tuple(w_in.shape)} and w_out "
            f"{tuple(w_out.shape)} disagree on the hidden size or the expert count"
        )
    if rows != (2 if gated else 1) * inter:
        raise ValueError(
            f"moe_experts: w_in has {rows} rows per expert, expected "
            f"{'2 x ' if gated else ''}{inter} ({'gated' if gated else 'plain'} experts)"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != len(x):
        raise ValueError(
            f"moe_experts: routing ids {tuple(topk_ids.shape)} and weights "
            f"{tuple(topk_weights.shape)} must both be [tokens={len(x)}, top_k]"
        )
    if not (x.dtype == w_in.dtype == w_out.dtype) or x.dtype not in (
        torch.bfloat16, torch.float16, torch.float32
    ):  # fmt: skip
        raise TypeError(
            f"moe_experts: x {x.dtype}, w_in {w_in.dtype} and w_out {w_out.dtype} must share "
            "a float dtype"
        )
    if w_in.stride(2) != 1 or w_out.stride(2) != 1:
        raise ValueError("moe_experts: expert weights must be contiguous along their last dim")
    return ACTIVATIONS[activation]


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMM's layout, on the device with static shapes: `(sorted_ids [P],
    block_expert [P // block_m])`. Each expert's assignments (flat indices into
    `topk_ids`, in index order) start at a multiple of `block_m`; padding entries hold
    `A = topk_ids.numel()`; `block_expert[b]` is the expert of block b, or `num_experts`
    for blocks past the last expert's."""
    flat = topk_ids.reshape(-1)
    assignments = flat.numel()
    device = flat.device
    size = triton.cdiv(assignments + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat.index_select(0, order)
    rank = torch.arange(assignments, device=device) - start.index_select(0, experts_sorted)
    dest = padded_end.index_select(0, experts_sorted) - padded.index_select(0, experts_sorted)
    sorted_ids = torch.full((size,), assignments, dtype=torch.int64, device=device)
    sorted_ids.index_copy_(0, dest + rank, order)
    block_starts = torch.arange(0, size, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_ids, block_expert


def moe_experts(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, gated: bool, activation: str, *, path: str | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`ssm_reference.moe_experts` on the device (see there for the operands). `path`:
    "gemv" or "grouped" forces a path (tests, benchmarks); None: `use_gemv`. `pdl`: the
    kernels launch as programmatic dependents (each waits for its predecessor on entry)."""
    act = _check(x, w_in, w_out, topk_ids, topk_weights, gated, activation)
    return _experts(x, w_in, w_out, topk_ids, topk_weights, gated, act, path, pdl, None)


def moe_softmax_experts(
    x: torch.Tensor, logits: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, top_k: int,
    renormalize: bool, weights_dtype: torch.dtype, gated: bool, activation: str, *,
    path: str | None = None, pdl: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`ssm_reference.moe_softmax_experts`: softmax routing from the router `logits [T, E]`
    then the experts. On the GEMV path the routing runs inside the gate/up kernel (one launch
    fewer per layer at decode); on the grouped path `moe_softmax_topk` runs first."""
    tokens = x.shape[0]
    if logits.dim() != 2 or logits.shape[0] != tokens or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(
            f"moe_softmax_experts: top_k {top_k} of router logits {tuple(logits.shape)} for "
            f"{tokens} tokens"
        )
    if logits.shape[1] != w_in.shape[0]:
        raise ValueError(
            f"moe_softmax_experts: {logits.shape[1]} router logits per token, "
            f"{w_in.shape[0]} experts"
        )
    if path is None:
        path = "gemv" if use_gemv(tokens, top_k, w_in.shape[0]) else "grouped"
    if path != "gemv":
        ids, weights = moe_softmax_topk(logits, top_k, renormalize, weights_dtype, pdl=pdl)
        return moe_experts(x, w_in, w_out, ids, weights, gated, activation, path=path, pdl=pdl)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=x.device)
    weights = torch.empty((tokens, top_k), dtype=weights_dtype, device=x.device)
    act = _check(x, w_in, w_out, ids, weights, gated, activation)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    route = (logits, renormalize)
    return _experts(x, w_in, w_out, ids, weights, gated, act, "gemv", pdl, route)


def _experts(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, gated: bool, act: int, path: str | None, pdl: bool,
    route: tuple[torch.Tensor, bool] | None,
) -> torch.Tensor:  # fmt: skip
    """Both paths and the combine; `route` (GEMV only): `(logits, renormalize)`, the up
    kernel then fills `topk_ids` / `topk_weights` itself."""
    tokens, top_k = topk_ids.shape
    experts, _, hidden = w_in.shape
    inter = w_out.shape[2]
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    assignments = tokens * top_k
    if path is None:
        path = "gemv" if use_gemv(tokens, top_k, experts) else "grouped"
    y = torch.empty((assignments, hidden), dtype=x.dtype, device=x.device)
    if path == "gemv":
        _run_gemv(x, w_in, w_out, ids, weights, y, top_k, inter, gated, act, pdl, route)
    elif path == "grouped":
        _run_grouped(x, w_in, w_out, topk_ids, y, top_k, inter, gated, act, pdl)
    else:
        raise ValueError(f"moe_experts: unknown path '{path}' (gemv or grouped)")
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        y, weights, out, hidden, y.stride(0), out.stride(0), TOPK=top_k, BLOCK=block, PDL=pdl,
        num_warps=4, **pdl_options(pdl),
    )  # fmt: skip
    return out


def _run_gemv(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, ids: torch.Tensor,
    weights: torch.Tensor, y: torch.Tensor, top_k: int, inter: int, gated: bool, act: int,
    pdl: bool, route: tuple[torch.Tensor, bool] | None,
) -> None:  # fmt: skip
    assignments, hidden = y.shape
    h = torch.empty((assignments, inter), dtype=x.dtype, device=x.device)
    block_n, block_k = _gemv_blocks(x.dtype, gated, hidden)
    logits = route[0] if route is not None else x
    experts = logits.shape[1] if route is not None else 1
    _gemv_up_kernel[(assignments, triton.cdiv(inter, block_n))](
        x, w_in, ids, h, logits, weights, inter, hidden, x.stride(0), w_in.stride(0),
        w_in.stride(1), h.stride(0), experts, logits.stride(0),
        TOPK=top_k, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        GATED=gated, ACT=act, STAGES=3, ROUTE=route is not None,
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_TK=triton.next_power_of_2(top_k),
        RENORM=route is not None and route[1], PDL=pdl, num_warps=4, num_stages=3,
        **pdl_options(pdl),
    )  # fmt: skip
    block_n, block_k = _gemv_blocks(x.dtype, False, inter)
    _gemv_down_kernel[(assignments, triton.cdiv(hidden, block_n))](
        h, w_out, ids, y, hidden, inter, h.stride(0), w_out.stride(0), w_out.stride(1),
        y.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=inter % block_k == 0, STAGES=3, PDL=pdl,
        num_warps=4, num_stages=3, **pdl_options(pdl),
    )  # fmt: skip


def _run_grouped(
    x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, topk_ids: torch.Tensor,
    y: torch.Tensor, top_k: int, inter: int, gated: bool, act: int, pdl: bool,
) -> None:  # fmt: skip
    assignments, hidden = y.shape
    experts = w_in.shape[0]
    block_m, block_n, block_k = _grouped_blocks(x.dtype, assignments, experts)
    sorted_ids, block_expert = sort_by_expert(topk_ids, experts, block_m)
    blocks = block_expert.numel()
    h = torch.empty((sorted_ids.numel(), inter), dtype=x.dtype, device=x.device)
    upcast = interpreting()
    ieee = x.dtype == torch.float32
    _grouped_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w_in, sorted_ids, block_expert, h, assignments, experts, inter, hidden,
        x.stride(0), w_in.stride(0), w_in.stride(1), h.stride(0),
        TOPK=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, ACT=act,
        UPCAST=upcast, IEEE=ieee, PDL=pdl, num_warps=4, num_stages=3, **pdl_options(pdl),
    )  # fmt: skip
    _grouped_down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w_out, sorted_ids, block_expert, y, assignments, experts, hidden, inter,
        h.stride(0), w_out.stride(0), w_out.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, IEEE=ieee, PDL=pdl,
        num_warps=4, num_stages=3, **pdl_options(pdl),
    )  # fmt: skip
