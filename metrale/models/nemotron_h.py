"""Nemotron-H: a hybrid where every layer is exactly one block (Mamba-2 mixer, attention
without positional encoding, a plain MLP, or a sigmoid-routed MoE) after one RMSNorm.

Owner: models.

Invariants:
- The block layout comes from `hybrid_override_pattern` (published checkpoints: `M` mamba,
  `*` attention, `-` MLP, `E` MoE) or `layers_block_type` (transformers 5: `linear_attention`,
  `full_attention`, `mlp`, `moe`); the layer count follows it. Mamba fields are read under
  both their names (`n_groups`/`mamba_n_groups`, `conv_kernel`/`mamba_d_conv`, ...).
- Checkpoint names are `backbone.*` (both published and transformers-written checkpoints) and
  become `model.*` here; per-expert MoE tensors stack into `experts.up_proj`/`down_proj`.
- As in transformers: attention has no rotary embedding and no biases; the LM head is never
  tied; the mixer clamps prefill dt at `time_step_min`.
- Unsupported options (MoE latent projection) are refused with a `CheckpointError` naming them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from metrale.errors import CheckpointError
from metrale.kernels import KernelOps
from metrale.layers.common import PagedSelfAttention, RMSNorm
from metrale.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from metrale.layers.moe import DenseMLP, MoeSpec, SparseMoeBlock
from metrale.model_config import ModelConfig
from metrale.models.hybrid import CacheKind, HybridForCausalLM, HybridLayer, HybridStack
from metrale.models.loader import ExpertShard, WeightMapping, qkv_shards

PATTERN_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
LIST_NAMES = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}


def _get(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    return default


def block_types(raw: dict[str, Any], source: str = "config.json") -> list[str]:
    """Per layer one of `mamba`, `attention`, `mlp`, `moe`, from either config layout."""
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if isinstance(listed, list) and listed:
        unknown = sorted({t for t in listed if t not in LIST_NAMES})
        if unknown:
            raise CheckpointError(f"{source}: unknown Nemotron-H block types {unknown}")
        return [LIST_NAMES[t] for t in listed]
    pattern = raw.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        unknown = sorted({c for c in pattern if c not in PATTERN_CHARS})
        if unknown:
            raise CheckpointError(
                f"{source}: hybrid_override_pattern has unknown block characters {unknown}"
            )
        return [PATTERN_CHARS[c] for c in pattern]
    raise CheckpointError(
        f"{source}: a Nemotron-H config needs 'hybrid_override_pattern' or 'layers_block_type'"
    )


def mamba_spec(cfg: ModelConfig) -> Mamba2Spec:
    raw = cfg.raw
    heads = int(_get(raw, "mamba_num_heads", default=128))
    return Mamba2Spec(
        hidden_size=cfg.hidden_size,
        num_heads=heads,
        head_dim=int(_get(raw, "mamba_head_dim", default=64)),
        state_size=int(_get(raw, "ssm_state_size", "mamba_d_state", default=128)),
        n_groups=int(_get(raw, "n_groups", "mamba_n_groups", default=8)),
        conv_kernel=int(_get(raw, "conv_kernel", "mamba_d_conv", default=4)),
        chunk_size=int(_get(raw, "chunk_size", "mamba_chunk_size", default=128)),
        eps=float(_get(raw, "layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
        use_conv_bias=bool(_get(raw, "use_conv_bias", "mamba_conv_bias", default=True)),
        use_bias=bool(_get(raw, "use_bias", default=False)),
        activation=str(_get(raw, "mamba_hidden_act", default="silu")),
        prefill_dt_limit=(float(_get(raw, "time_step_min", "mamba_dt_min", default=0.001)),
                          float("inf")),
    )  # fmt: skip


def moe_block(cfg: ModelConfig, ops: KernelOps, source: str) -> SparseMoeBlock:
    raw = cfg.raw
    if raw.get("moe_latent_size") is not None:
        raise CheckpointError(f"{source}: Nemotron-H 'moe_latent_size' is not supported")
    experts = int(_get(raw, "n_routed_experts", "num_local_experts", default=8))
    groups = int(_get(raw, "n_group", default=1))
    if experts % groups:
        raise CheckpointError(
            f"{source}: n_routed_experts ({experts}) is not a multiple of n_group"
        )
    spec = MoeSpec(
        hidden_size=cfg.hidden_size,
        num_experts=experts,
        top_k=int(_get(raw, "num_experts_per_tok", default=2)),
        intermediate_size=int(_get(raw, "moe_intermediate_size", default=7688)),
        routing="sigmoid_group",
        renormalize=bool(_get(raw, "norm_topk_prob", default=True)),
        gated=False,
        activation=str(_get(raw, "mlp_hidden_act", default="relu2")),
        num_groups=groups,
        topk_groups=int(_get(raw, "topk_group", default=1)),
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
    )
    shared = int(_get(raw, "moe_shared_expert_intermediate_size", default=spec.intermediate_size))
    return SparseMoeBlock(spec, ops, shared_intermediate=shared, shared_name="shared_experts")


class NemotronHBlock(HybridLayer):
    input_norm_name = "norm"
    post_norm_name = None  # one mixer per block: attention, Mamba-2, MLP or MoE
    mixer_names = dict.fromkeys(CacheKind, "mixer")

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, kind: str, ops: KernelOps, source: str
    ) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.kind = kind
        self.mixer: nn.Module
        if kind == "mamba":
            self.cache_kind = CacheKind.RECURRENT
            self.mixer = Mamba2Mixer(mamba_spec(cfg), ops)
        elif kind == "attention":
            self.cache_kind = CacheKind.ATTENTION
            # Nemotron-H attention: no positional encoding and no biases, whatever
            # `attention_bias` says (transformers hard-codes bias=False).
            unbiased = dataclasses.replace(cfg, attention_bias=False, o_proj_bias=False)
            self.mixer = PagedSelfAttention(unbiased, layer_idx, None, ops)
        elif kind == "mlp":
            act = str(_get(cfg.raw, "mlp_hidden_act", default="relu2"))
            self.mixer = DenseMLP(cfg.hidden_size, cfg.intermediate_size, False, act, cfg.mlp_bias)
        else:
            self.mixer = moe_block(cfg, ops, source)


class NemotronHStack(HybridStack):
    embed_name = "embeddings"
    final_norm_name = "norm_f"

    def __init__(self, cfg: ModelConfig, ops: KernelOps, source: str) -> None:
        super().__init__()
        kinds = block_types(cfg.raw, source)
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [NemotronHBlock(cfg, i, kind, ops, source) for i, kind in enumerate(kinds)]
        )
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class NemotronHForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int) -> None:
        super().__init__(cfg)
        self.tied = False  # transformers never ties Nemotron-H's LM head
        self.model = NemotronHStack(cfg, ops, f"{cfg.architecture} config")
        self._add_lm_head()

    def weight_mapping(self) -> WeightMapping:
        c = self.config
        moe_inter = int(_get(c.raw, "moe_intermediate_size", default=7688))
        return WeightMapping(
            stacked=qkv_shards(c),
            experts=[
                ExpertShard("up_proj", "up_proj", 0, moe_inter),
                ExpertShard("down_proj", "down_proj", 0, c.hidden_size),
            ],
            rename=_rename,
        )


def _rename(name: str) -> str:
    return "model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name
