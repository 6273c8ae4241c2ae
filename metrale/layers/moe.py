"""Sparse mixture-of-experts blocks: a router (top-k with each family's normalisation), the
experts as two stacked weight tensors, and optional shared experts.

Owner: layers. A softmax-routed block runs its routing and experts as one op,
`KernelOps.moe_softmax_experts` (`moe_softmax_topk` then `moe_experts`; on CUDA's decode path
the routing is fused into the experts' first kernel, elsewhere it is one Triton kernel instead
of five torch ones); a sigmoid-group block routes in torch, then calls
`KernelOps.moe_experts`: on the CPU
the torch reference (tokens sorted by expert, one matmul per expert, no Python loop over
tokens), on CUDA the Triton op of `kernels.triton_moe` (a gathered GEMV for decode batches, a
sorted grouped GEMM above), which never reads routing data on the host.

Invariants:
- Parameter names follow transformers 5's in-memory layout: `gate.weight` (router),
  `experts.gate_up_proj [E, 2I, H]` (gated experts) or `experts.up_proj [E, I, H]`,
  `experts.down_proj [E, H, I]`; the loader fills them from per-expert checkpoint tensors
  (`experts.<e>.gate_proj.weight`, ...) or from fused ones.
- Routing:
  * `softmax`: softmax over all experts in float32, top-k, then (if `renormalize`) divided by
    the sum of the k chosen, which equals a softmax over the chosen logits (Mixtral always
    renormalises; Qwen3-MoE / Qwen3-Next follow `norm_topk_prob`).
  * `sigmoid_group`: Nemotron-H / DeepSeek-V3 routing: sigmoid scores, a per-expert correction
    bias used only for choosing, group-limited top-k, optional renormalisation, then
    `routed_scaling_factor`.
- Shared experts are added to every token: Qwen3-Next scales theirs by a sigmoid gate.
- Nothing here syncs with the host (routing is softmax/sigmoid, top-k, scatter and gather on
  the device), so on CUDA an MoE layer is captured in the decode graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metrale.kernels import KernelOps
from metrale.kernels.ssm_reference import apply_activation


@dataclass(frozen=True)
class MoeSpec:
    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    #: "softmax" or "sigmoid_group".
    routing: str = "softmax"
    renormalize: bool = True
    #: Gated experts (`act(gate) * up`) or plain (`act(up)`).
    gated: bool = True
    activation: str = "silu"
    #: Cast the routing weights to the hidden dtype (Qwen3 routers do, Mixtral's does not).
    weights_in_hidden_dtype: bool = True
    #: sigmoid_group routing only.
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0


class FusedExperts(nn.Module):
    """All experts' weights as two stacked tensors."""

    def __init__(self, spec: MoeSpec, ops: KernelOps) -> None:
        super().__init__()
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        if spec.gated:
            self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        else:
            self.up_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gated = spec.gated
        self.activation = spec.activation
        self.ops = ops

    def weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w_in, w_out)`: gate|up (or up) and down, stacked over experts."""
        return (self.gate_up_proj if self.gated else self.up_proj), self.down_proj

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        w_in, w_out = self.weights()
        return self.ops.moe_experts(
            x, w_in, w_out, topk_ids, topk_weights, self.gated, self.activation
        )


class Router(nn.Module):
    def __init__(self, spec: MoeSpec, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, spec.hidden_size))
        if spec.routing == "sigmoid_group":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts))
        elif spec.routing != "softmax":
            raise ValueError(f"unknown MoE routing '{spec.routing}'")
        self.spec = spec
        self.ops = ops

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(topk_ids [T, k], topk_weights [T, k])`."""
        s = self.spec
        if s.routing == "softmax":
            # `ops.linear`: on CUDA the GEMV of few-row batches joins the decode chain's
            # programmatic dependent launches (cuBLAS above); on the CPU, F.linear below
            # oneDNN's size threshold (every tiny test router), oneDNN above.
            logits = self.ops.linear(x, self.weight)
            out_dtype = logits.dtype if s.weights_in_hidden_dtype else torch.float32
            return self.ops.moe_softmax_topk(logits, s.top_k, s.renormalize, out_dtype)
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        per_group = s.num_experts // s.num_groups
        grouped = choice.view(-1, s.num_groups, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=s.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = (
            group_mask.unsqueeze(-1).expand(-1, s.num_groups, per_group).reshape(-1, s.num_experts)
        )
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = torch.topk(choice, k=s.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if s.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * s.routed_scaling_factor


class DenseMLP(nn.Module):
    """A dense MLP or shared expert, gated (`down(act(gate) * up)`) or plain (`down(act(up))`),
    with transformers' unfused names (its width often differs from other MLPs of the model,
    so one fused gate|up loader rule could not serve both)."""

    def __init__(
        self, hidden: int, intermediate: int, gated: bool, activation: str, bias: bool = False
    ) -> None:
        super().__init__()
        if gated:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.gated = gated
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(
                apply_activation(self.gate_proj(x), self.activation) * self.up_proj(x)
            )
        return self.down_proj(apply_activation(self.up_proj(x), self.activation))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ shared experts). `forward(x [T, H]) -> [T, H]`."""

    def __init__(
        self,
        spec: MoeSpec,
        ops: KernelOps,
        *,
        shared_intermediate: int = 0,
        shared_name: str = "shared_expert",
        shared_gate: bool = False,
    ) -> None:
        super().__init__()
        self.gate = Router(spec, ops)
        self.experts = FusedExperts(spec, ops)
        self.shared_name = shared_name if shared_intermediate else None
        if shared_intermediate:
            shared = DenseMLP(spec.hidden_size, shared_intermediate, spec.gated, spec.activation)
            self.add_module(shared_name, shared)
            if shared_gate:
                self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)
        self.has_shared_gate = bool(shared_intermediate) and shared_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.gate.spec
        if spec.routing == "softmax":
            # One op from the router logits: on CUDA's decode path the routing runs inside
            # the experts' first kernel.
            logits = self.gate.ops.linear(x, self.gate.weight)
            out = self.experts.ops.moe_softmax_experts(
                x, logits, *self.experts.weights(), spec.top_k, spec.renormalize,
                logits.dtype if spec.weights_in_hidden_dtype else torch.float32,
                spec.gated, spec.activation,
            )  # fmt: skip
        else:
            ids, weights = self.gate(x)
            out = self.experts(x, ids, weights)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(x)
            if self.has_shared_gate:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
