"""Softmax routing of mixture-of-experts models on CUDA: `moe_softmax_topk` (softmax, top-k,
renormalisation, cast in one kernel, one program per token row) and `_route_row`, the row
routine that `triton_moe`'s fused gate/up GEMV (`moe_softmax_experts`) also runs per program.

Owner: kernels. `moe_softmax_topk` is the CUDA entry of the `KernelOps` field of that name
(`triton_ops.TRITON_OPS`); `tests/gpu/test_moe_kernels.py` checks it against
`ssm_reference.moe_softmax_topk`.

Invariants:
- The top k is taken by repeated argmax over float32 probabilities: descending, ties to the
  lower expert id, as `torch.topk` orders them; renormalised in float32 when asked, then
  cast once to the weights' dtype.
- No host read: shapes alone pick the launch, so decode graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import pdl_enter, pdl_options


@triton.jit
def _route_row(
    logits_ptr, t, E, stride_l,
    TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr,
):  # fmt: skip
    """Softmax of row `t` of the router logits (float32), its top k by repeated argmax (ties
    to the lower id; descending, as `torch.topk`), renormalised if RENORM: `(ids [BLOCK_K],
    weights [BLOCK_K] float32)`, slots past TOPK unused."""
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t.to(tl.int64) * stride_l + offs, mask=offs < E,
                other=float("-inf")).to(tl.float32)  # fmt: skip
    p = tl.exp(x - tl.max(x, axis=0))
    probs = p / tl.sum(p, axis=0)
    probs = tl.where(offs < E, probs, -1.0)
    slots = tl.arange(0, BLOCK_K)
    chosen_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(probs, axis=0)
        idx = tl.min(tl.where(probs == best, offs, BLOCK_E), axis=0)
        chosen_ids = tl.where(slots == j, idx.to(tl.int64), chosen_ids)
        chosen = tl.where(slots == j, best, chosen)
        probs = tl.where(offs == idx, -2.0, probs)
    if RENORM:
        chosen = chosen / tl.sum(chosen, axis=0)
    return chosen_ids, chosen


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, ids_ptr, weights_ptr, E, stride_l,
    TOPK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Grid `(T,)`: `_route_row` of each token row, stored as `ids` / `weights [T, TOPK]`."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    chosen_ids, chosen = _route_row(logits_ptr, t, E, stride_l, TOPK, BLOCK_E, BLOCK_K, RENORM)
    slots = tl.arange(0, BLOCK_K)
    out = t.to(tl.int64) * TOPK + slots
    tl.store(ids_ptr + out, chosen_ids, mask=slots < TOPK)
    tl.store(weights_ptr + out, chosen.to(weights_ptr.dtype.element_ty), mask=slots < TOPK)


def moe_softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype, *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`ssm_reference.moe_softmax_topk` in one launch (the reference's softmax, top-k,
    sum, divide and cast are five); `pdl`: as a programmatic dependent."""
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"moe_softmax_topk: top_k {top_k} of router logits {tuple(logits.shape)}")
    tokens, experts = logits.shape
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    weights = torch.empty((tokens, top_k), dtype=out_dtype, device=logits.device)
    if tokens == 0:
        return ids, weights
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_e = triton.next_power_of_2(experts)
    _softmax_topk_kernel[(tokens,)](
        logits, ids, weights, experts, logits.stride(0),
        TOPK=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), RENORM=renormalize,
        PDL=pdl, num_warps=1 if block_e <= 256 else 4, **pdl_options(pdl),
    )  # fmt: skip
    return ids, weights
