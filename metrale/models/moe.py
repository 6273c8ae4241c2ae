"""Mixture-of-experts decoders on the dense family's frame: Qwen3-MoE and Mixtral. Attention,
norms and rotary are the dense family's; the MLP of a sparse layer is a `SparseMoeBlock`.

Owner: models.

Invariants:
- Qwen3-MoE: softmax routing, renormalised over the top k only when `norm_topk_prob`; layers
  in `mlp_only_layers`, or not on the `decoder_sparse_step` stride, keep a dense MLP of
  `intermediate_size`. Experts have `moe_intermediate_size`.
- Mixtral: softmax over the chosen experts' logits (softmax, top-k, renormalise); every layer
  is sparse; experts have `intermediate_size`.
- The expert count is read as `num_experts` or `num_local_experts` (transformers 5 writes the
  latter for both families).
- Checkpoints store experts one by one (`experts.<e>.gate_proj|up_proj|down_proj` for Qwen3,
  `block_sparse_moe.experts.<e>.w1|w3|w2` for Mixtral) or already fused
  (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`); both load.
"""

from __future__ import annotations

from torch import nn

from metrale.errors import CheckpointError
from metrale.kernels import KernelOps
from metrale.layers.common import GatedMLP
from metrale.layers.moe import MoeSpec, SparseMoeBlock
from metrale.model_config import ModelConfig
from metrale.models.llama import DecoderLayer, DecoderStack, LlamaForCausalLM
from metrale.models.loader import ExpertShard, WeightMapping


def expert_count(cfg: ModelConfig) -> int:
    n = cfg.raw.get("num_experts") or cfg.raw.get("num_local_experts")
    if not n:
        raise CheckpointError(f"{cfg.architecture}: config.json lacks 'num_experts'")
    return int(n)


def moe_intermediate(cfg: ModelConfig) -> int:
    """The experts' width; a sparse layer without it cannot be built."""
    n = cfg.raw.get("moe_intermediate_size")
    if not n:
        raise CheckpointError(f"{cfg.architecture}: config.json lacks 'moe_intermediate_size'")
    return int(n)


class Qwen3MoeDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg: ModelConfig, layer_idx: int, ops: KernelOps) -> nn.Module:
        raw = cfg.raw
        step = int(raw.get("decoder_sparse_step") or 1)
        if layer_idx in (raw.get("mlp_only_layers") or []) or (layer_idx + 1) % step != 0:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, cfg.hidden_act, ops)
        spec = MoeSpec(
            hidden_size=cfg.hidden_size,
            num_experts=expert_count(cfg),
            top_k=int(raw.get("num_experts_per_tok") or 1),
            intermediate_size=moe_intermediate(cfg),
            renormalize=bool(raw.get("norm_topk_prob", False)),
            activation=cfg.hidden_act,
        )
        return SparseMoeBlock(spec, ops)


class MixtralDecoderLayer(DecoderLayer):
    def build_mlp(self, cfg: ModelConfig, layer_idx: int, ops: KernelOps) -> nn.Module:
        spec = MoeSpec(
            hidden_size=cfg.hidden_size,
            num_experts=expert_count(cfg),
            top_k=int(cfg.raw.get("num_experts_per_tok") or 2),
            intermediate_size=cfg.intermediate_size,
            renormalize=True,
            activation=cfg.hidden_act,
            weights_in_hidden_dtype=False,
        )
        return SparseMoeBlock(spec, ops)


class Qwen3MoeStack(DecoderStack):
    layer_class = Qwen3MoeDecoderLayer


def qwen3_moe_experts(cfg: ModelConfig) -> list[ExpertShard]:
    """Where Qwen3-MoE's expert projections (gate, up, down) go in the fused `gate_up_proj` /
    `down_proj` stacks (Qwen3-VL-MoE's text decoder is the same)."""
    inter = int(cfg.raw.get("moe_intermediate_size") or 0)
    return [
        ExpertShard("gate_up_proj", "gate_proj", 0, inter),
        ExpertShard("gate_up_proj", "up_proj", inter, inter),
        ExpertShard("down_proj", "down_proj", 0, cfg.hidden_size),
    ]


class MixtralStack(DecoderStack):
    layer_class = MixtralDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    stack_class = Qwen3MoeStack

    def weight_mapping(self) -> WeightMapping:
        mapping = super().weight_mapping()
        mapping.experts = qwen3_moe_experts(self.config)
        return mapping


class MixtralForCausalLM(LlamaForCausalLM):
    stack_class = MixtralStack

    def weight_mapping(self) -> WeightMapping:
        mapping = super().weight_mapping()
        inter = self.config.intermediate_size
        mapping.experts = [
            ExpertShard("gate_up_proj", "w1", 0, inter),
            ExpertShard("gate_up_proj", "w3", inter, inter),
            ExpertShard("down_proj", "w2", 0, self.config.hidden_size),
        ]
        mapping.rename = _mixtral_rename
        return mapping


def _mixtral_rename(name: str) -> str:
    return name.replace(".block_sparse_moe.", ".mlp.")
