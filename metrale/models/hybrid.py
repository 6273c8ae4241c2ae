"""The frame the hybrid families (Nemotron-H, Bamba, Qwen3-Next) share: a stack whose layers
each hold paged KV (attention), a recurrent state in the SSM slot pool, or nothing (MLP/MoE
blocks), and the causal-LM wrapper the model engine drives.

Owner: models.

Invariants:
- The module interface is the dense family's (`forward(input_ids, positions, meta, kv_caches)`,
  `compute_logits`, `weight_mapping()`, `kv_layer_count`) plus `ssm_states`: per recurrent
  layer, in layer order, the `(conv_states, ssm_states)` pool tensors; `ssm_layer_specs()`
  gives their per-slot shapes so the factory can size the pool.
- `kv_caches[i]` belongs to the i-th attention layer, `ssm_states[j]` to the j-th recurrent
  layer, both counted in layer order.
- Layers thread the residual like the dense family (`forward_add` norms), which computes
  transformers' `residual + x` then norm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum

import torch
from torch import nn

from metrale.cache.ssm_pool import SsmLayerSpec
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.common import LayerCache, LayerCaches, PreNormLayer
from metrale.model_config import ModelConfig
from metrale.models.loader import WeightMapping


class CacheKind(Enum):
    ATTENTION = "attention"
    RECURRENT = "recurrent"
    NONE = "none"


class HybridLayer(PreNormLayer):
    """One layer of a hybrid stack (the frame around its mixer is `PreNormLayer`'s).
    Subclasses set `cache_kind` and name, per kind, the submodule that mixes tokens
    (`mixer_names`, checkpoint names): attention takes `(positions, x, meta, kv)`, a recurrent
    mixer `(x, meta, state)` and exposes `spec.state_spec()`, a cacheless block `(x)`."""

    cache_kind: CacheKind = CacheKind.NONE
    mixer_names: dict[CacheKind, str] = {
        CacheKind.ATTENTION: "self_attn",
        CacheKind.RECURRENT: "mixer",
        CacheKind.NONE: "mixer",
    }

    def ssm_spec(self) -> SsmLayerSpec:
        if self.cache_kind is not CacheKind.RECURRENT:
            raise TypeError(f"{type(self).__name__} holds no recurrent state")
        return getattr(self, self.mixer_names[CacheKind.RECURRENT]).spec.state_spec()

    def mix(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache
    ) -> torch.Tensor:
        mixer = getattr(self, self.mixer_names[self.cache_kind])
        if self.cache_kind is CacheKind.NONE:
            return mixer(x)
        assert cache is not None
        if self.cache_kind is CacheKind.RECURRENT:
            return mixer(x, meta, cache)
        return mixer(positions, x, meta, cache)


class HybridStack(nn.Module):
    """Embedding, layers, final norm. Subclasses build them under the checkpoint's names, given
    by `embed_name` and `final_norm_name` (a norm with `forward_add`)."""

    layers: nn.ModuleList
    embed_name = "embed_tokens"
    final_norm_name = "norm"

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.embed_name)(input_ids)

    def final_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(after the final norm, the residual stream before it)`."""
        return getattr(self, self.final_norm_name).forward_add(hidden, residual)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
        ssm_states: LayerCaches,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(after the final norm, the residual stream before it)` for every row."""
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        kv_iter, ssm_iter = iter(kv_caches), iter(ssm_states)
        for layer in self.layers:
            kind = layer.cache_kind
            cache = (
                next(kv_iter)
                if kind is CacheKind.ATTENTION
                else next(ssm_iter)
                if kind is CacheKind.RECURRENT
                else None
            )
            hidden, residual = layer(positions, hidden, residual, meta, cache)
        assert residual is not None
        return self.final_norm(hidden, residual)


class HybridForCausalLM(nn.Module, ABC):
    """Causal LM over a `HybridStack` (`self.model`) with an untied or tied LM head."""

    model: HybridStack

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tied = cfg.tie_word_embeddings

    def _add_lm_head(self) -> None:
        if not self.tied:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)

    def _layers_of(self, kind: CacheKind) -> list[HybridLayer]:
        return [layer for layer in self.model.layers if layer.cache_kind is kind]

    @property
    def kv_layer_count(self) -> int:
        return len(self._layers_of(CacheKind.ATTENTION))

    def ssm_layer_specs(self) -> list[SsmLayerSpec]:
        return [layer.ssm_spec() for layer in self._layers_of(CacheKind.RECURRENT)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
        ssm_states: LayerCaches | None = None,
    ) -> torch.Tensor:
        return self.forward_for_mtp(input_ids, positions, meta, kv_caches, ssm_states)[0]

    def forward_for_mtp(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
        ssm_states: LayerCaches | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(hidden after the final norm, the hidden an MTP head reads)` for every row: the
        stream before the final norm, or after it where the head says so."""
        if ssm_states is None:
            raise ValueError("a hybrid model's forward needs the SSM slot pool's layers")
        post, pre = self.model(input_ids, positions, meta, kv_caches, ssm_states)
        mtp = getattr(self, "mtp", None)
        return post, pre if mtp is not None and mtp.hidden_before_norm else post

    @property
    def has_mtp(self) -> bool:
        return hasattr(self, "mtp")

    def input_embeddings(self) -> nn.Embedding:
        return getattr(self.model, self.model.embed_name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.input_embeddings().weight if self.tied else self.lm_head.weight
        return hidden @ weight.t()

    @abstractmethod
    def weight_mapping(self) -> WeightMapping: ...

    def drop_optional_weights(self, prefixes: set[str]) -> None:
        """Remove submodules whose weights the checkpoint does not have (see
        `WeightMapping.optional_prefixes`)."""
        for prefix in prefixes:
            name = prefix.rstrip(".")
            if hasattr(self, name):
                delattr(self, name)
