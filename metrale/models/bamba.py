"""Bamba: a hybrid of Mamba-2 mixers and Llama-style attention layers (partial rotary), each
followed by a gated MLP; the same Mamba-2 mixer as Nemotron-H.

Owner: models.

Invariants:
- Attention layers are those in `attn_layer_indices` (or `full_attention` entries of a
  `layers_block_type` / `layer_types` list); every other layer is a Mamba-2 mixer.
- Rotary covers half of each head unless the config says otherwise (`rope_parameters` or
  top-level `partial_rotary_factor`), as transformers hard-codes 0.5 for this family.
- The mixer clamps prefill dt to the config's `time_step_limit`, like transformers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import nn

from metrale.errors import CheckpointError
from metrale.kernels import KernelOps
from metrale.layers.common import GatedMLP, PagedSelfAttention, RMSNorm
from metrale.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from metrale.layers.rotary import RotaryEmbedding
from metrale.model_config import ModelConfig
from metrale.models.hybrid import CacheKind, HybridForCausalLM, HybridLayer, HybridStack
from metrale.models.loader import WeightMapping, dense_weight_mapping

#: transformers' BambaConfig forces this partial rotary factor.
BAMBA_PARTIAL_ROTARY = 0.5


def attention_layers(raw: dict[str, Any], num_layers: int, source: str) -> set[int]:
    listed = raw.get("layers_block_type") or raw.get("layer_types")
    if isinstance(listed, list) and listed:
        if len(listed) != num_layers:
            raise CheckpointError(f"{source}: layer type list does not have {num_layers} entries")
        return {i for i, t in enumerate(listed) if t in ("full_attention", "attention")}
    indices = raw.get("attn_layer_indices") or []
    bad = [i for i in indices if not 0 <= int(i) < num_layers]
    if bad:
        raise CheckpointError(f"{source}: attn_layer_indices {bad} are outside the layers")
    return {int(i) for i in indices}


def bamba_config(cfg: ModelConfig) -> ModelConfig:
    """The config with Bamba's partial rotary factor applied where the file leaves it out."""
    params = cfg.raw.get("rope_parameters") or {}
    explicit = "partial_rotary_factor" in params or "partial_rotary_factor" in cfg.raw
    if explicit:
        return cfg
    rope = dataclasses.replace(cfg.rope, partial_rotary_factor=BAMBA_PARTIAL_ROTARY)
    return dataclasses.replace(cfg, rope=rope)


def mamba_spec(cfg: ModelConfig) -> Mamba2Spec:
    raw = cfg.raw
    heads = int(raw.get("mamba_n_heads") or 128)
    expand = int(raw.get("mamba_expand") or 2)
    head_dim = raw.get("mamba_d_head")
    if head_dim in (None, "auto"):
        head_dim = expand * cfg.hidden_size // heads
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    return Mamba2Spec(
        hidden_size=cfg.hidden_size,
        num_heads=heads,
        head_dim=int(head_dim),
        state_size=int(raw.get("mamba_d_state") or 256),
        n_groups=int(raw.get("mamba_n_groups") or 1),
        conv_kernel=int(raw.get("mamba_d_conv") or 4),
        chunk_size=int(raw.get("mamba_chunk_size") or 256),
        eps=cfg.rms_norm_eps,
        use_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        use_bias=bool(raw.get("mamba_proj_bias", False)),
        activation=cfg.hidden_act,
        prefill_dt_limit=(_as_float(limit[0]), _as_float(limit[1])),
    )


def _as_float(value: Any) -> float:
    """A limit from config.json: a number, or transformers' `{"__float__": "Infinity"}`."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


class BambaLayer(HybridLayer):
    post_norm_name = "pre_ff_layernorm"
    mlp_name = "feed_forward"
    mixer_names = {CacheKind.ATTENTION: "self_attn", CacheKind.RECURRENT: "mamba"}

    def __init__(
        self, cfg: ModelConfig, layer_idx: int, attention: bool, rotary: RotaryEmbedding,
        ops: KernelOps,
    ) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.attention = attention
        if attention:
            self.cache_kind = CacheKind.ATTENTION
            self.self_attn = PagedSelfAttention(cfg, layer_idx, rotary, ops)
        else:
            self.cache_kind = CacheKind.RECURRENT
            self.mamba = Mamba2Mixer(mamba_spec(cfg), ops)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.feed_forward = GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, ops
        )


class BambaStack(HybridStack):
    final_norm_name = "final_layernorm"

    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int, source: str) -> None:
        super().__init__()
        attn = attention_layers(cfg.raw, cfg.num_hidden_layers, source)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(
            [BambaLayer(cfg, i, i in attn, self.rotary, ops) for i in range(cfg.num_hidden_layers)]
        )
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class BambaForCausalLM(HybridForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int) -> None:
        cfg = bamba_config(cfg)
        super().__init__(cfg)
        self.model = BambaStack(cfg, ops, max_positions, f"{cfg.architecture} config")
        self._add_lm_head()

    def weight_mapping(self) -> WeightMapping:
        return dense_weight_mapping(self.config, self.tied)
