"""Qwen3-Next: gated delta net layers and gated full-attention layers, each followed by a
sparse MoE with a sigmoid-gated shared expert (or a dense MLP on `mlp_only_layers`), plus the
multi-token-prediction (MTP) head when the checkpoint has one.

Owner: models.

Invariants:
- The layer layout is `layer_types` (`linear_attention` / `full_attention`) or, in published
  configs without it, every `full_attention_interval`-th layer is full attention.
- Every RMSNorm outside the gated delta net scales by `1 + weight` (weights are zero-centred),
  computed in float32 as transformers does.
- Full attention: `q_proj` yields per head `[query | gate]`; q and k get the (1 + w) RMSNorm
  per head, partial rotary (`partial_rotary_factor`, 0.25 when absent), and the attention
  output is multiplied by `sigmoid(gate)` before `o_proj`.
- MTP weights (`mtp.*`) are loaded into `self.mtp` when present and dropped when absent; the
  model engine runs them as the MTP draft proposer, on the hidden state after the final norm
  (as vLLM serves Qwen3-Next; `forward_for_mtp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from metrale.errors import CheckpointError
from metrale.kernels import KernelOps
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.common import (
    AttentionProjections,
    KvCache,
    kv_calibration_pending,
    kv_scale_kwargs,
)
from metrale.layers.gated_delta import GatedDeltaNet, GatedDeltaSpec
from metrale.layers.moe import DenseMLP, MoeSpec, SparseMoeBlock
from metrale.layers.rotary import RotaryEmbedding
from metrale.model_config import ModelConfig
from metrale.models.hybrid import CacheKind, HybridForCausalLM, HybridLayer, HybridStack
from metrale.models.loader import ExpertShard, WeightMapping, qkv_shards, rotary_and_tied_ignored
from metrale.models.moe import moe_intermediate
from metrale.models.mtp import MtpHead

DEFAULT_PARTIAL_ROTARY = 0.25


class OffsetRMSNorm(nn.Module):
    """`rmsnorm(x) * (1 + weight)` in float32, cast back to x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return self.forward(summed), summed


def layer_types(raw: dict[str, Any], num_layers: int, source: str) -> list[str]:
    listed = raw.get("layer_types")
    if isinstance(listed, list) and listed:
        if len(listed) != num_layers:
            raise CheckpointError(f"{source}: layer_types does not have {num_layers} entries")
        unknown = sorted({t for t in listed if t not in ("linear_attention", "full_attention")})
        if unknown:
            raise CheckpointError(f"{source}: unknown Qwen3-Next layer types {unknown}")
        return list(listed)
    interval = int(raw.get("full_attention_interval") or 4)
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def qwen3_next_config(cfg: ModelConfig) -> ModelConfig:
    params = cfg.raw.get("rope_parameters") or {}
    if "partial_rotary_factor" in params or "partial_rotary_factor" in cfg.raw:
        return cfg
    rope = dataclasses.replace(cfg.rope, partial_rotary_factor=DEFAULT_PARTIAL_ROTARY)
    return dataclasses.replace(cfg, rope=rope)


def num_experts(raw: dict[str, Any]) -> int:
    return int(raw.get("num_experts") or raw.get("num_local_experts") or 0)


def delta_spec(cfg: ModelConfig) -> GatedDeltaSpec:
    raw = cfg.raw
    return GatedDeltaSpec(
        hidden_size=cfg.hidden_size,
        num_k_heads=int(raw.get("linear_num_key_heads") or 16),
        num_v_heads=int(raw.get("linear_num_value_heads") or 32),
        head_k_dim=int(raw.get("linear_key_head_dim") or 128),
        head_v_dim=int(raw.get("linear_value_head_dim") or 128),
        conv_kernel=int(raw.get("linear_conv_kernel_dim") or 4),
        eps=cfg.rms_norm_eps,
        activation=cfg.hidden_act,
    )


class GatedAttention(AttentionProjections):
    """Paged self-attention with Qwen3-Next's output gate and (1 + w) q/k norms."""

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, ops: KernelOps
    ) -> None:
        super().__init__(cfg, rotary, ops, o_bias=cfg.attention_bias, q_factor=2)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, kv: KvCache
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv
        scales = kv_scale_kwargs(kv)
        if kv_calibration_pending(kv):
            kv.calibrate(k, v)  # type: ignore[attr-defined]
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
        out = self.ops.paged_attention(q, k_cache, v_cache, meta, self.scale, None, **scales)
        out = out.reshape(tokens, self.q_size) * torch.sigmoid(gate.reshape(tokens, self.q_size))
        return self.o_proj(out)


class Qwen3NextLayer(HybridLayer):
    mixer_names = {CacheKind.ATTENTION: "self_attn", CacheKind.RECURRENT: "linear_attn"}

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, kind: str, rotary: RotaryEmbedding,
        ops: KernelOps,
    ) -> None:  # fmt: skip
        super().__init__()
        raw = cfg.raw
        self.kind = kind
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if kind == "linear_attention":
            self.cache_kind = CacheKind.RECURRENT
            self.linear_attn = GatedDeltaNet(delta_spec(cfg), ops)
        else:
            self.cache_kind = CacheKind.ATTENTION
            self.self_attn = GatedAttention(cfg, layer_idx, rotary, ops)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        experts = num_experts(raw)
        sparse_step = int(raw.get("decoder_sparse_step") or 1)
        self.mlp: nn.Module
        if (
            layer_idx not in (raw.get("mlp_only_layers") or [])
            and experts > 0
            and (layer_idx + 1) % sparse_step == 0
        ):
            spec = MoeSpec(
                hidden_size=cfg.hidden_size,
                num_experts=experts,
                top_k=int(raw.get("num_experts_per_tok") or 1),
                intermediate_size=moe_intermediate(cfg),
                renormalize=bool(raw.get("norm_topk_prob", True)),
                activation=cfg.hidden_act,
            )
            shared = int(raw.get("shared_expert_intermediate_size") or 0)
            self.mlp = SparseMoeBlock(
                spec, ops, shared_intermediate=shared, shared_name="shared_expert",
                shared_gate=True,
            )  # fmt: skip
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, True, cfg.hidden_act)


class Qwen3NextStack(HybridStack):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int, source: str) -> None:
        super().__init__()
        kinds = layer_types(cfg.raw, cfg.num_hidden_layers, source)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(
            [Qwen3NextLayer(cfg, i, kind, self.rotary, ops) for i, kind in enumerate(kinds)]
        )
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextMTP(MtpHead):
    """The MTP head: `fc` over `[norm(embedding), norm(hidden)]`, decoder layers of the
    full-attention kind and a final norm (embedding and LM head are the main model's); it
    reads the hidden state after the main model's final norm."""

    hidden_before_norm = False

    def __init__(
        self, cfg: ModelConfig, num_layers: int, rotary: RotaryEmbedding, ops: KernelOps
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            [
                Qwen3NextLayer(cfg, cfg.num_hidden_layers + i, "full_attention", rotary, ops)
                for i in range(num_layers)
            ]
        )
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int) -> None:
        cfg = qwen3_next_config(cfg)
        super().__init__(cfg)
        self.model = Qwen3NextStack(cfg, ops, max_positions, f"{cfg.architecture} config")
        self._add_lm_head()
        mtp_layers = int(cfg.raw.get("num_nextn_predict_layers") or 0)
        if mtp_layers:
            self.mtp = Qwen3NextMTP(cfg, mtp_layers, self.model.rotary, ops)

    def weight_mapping(self) -> WeightMapping:
        c = self.config
        moe_inter = int(c.raw.get("moe_intermediate_size") or 0)
        return WeightMapping(
            stacked=qkv_shards(c, q_factor=2),  # q carries its output gate
            experts=[
                ExpertShard("gate_up_proj", "gate_proj", 0, moe_inter),
                ExpertShard("gate_up_proj", "up_proj", moe_inter, moe_inter),
                ExpertShard("down_proj", "down_proj", 0, c.hidden_size),
            ],
            optional_prefixes=("mtp.",),
            ignored_suffixes=rotary_and_tied_ignored(self.tied),
        )
