"""The dense decoder family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

Owner: models. One module covers the four architectures; their differences are config flags
(`attention_bias`, `qk_norm`, sliding windows) read by `ModelConfig`.

Invariants:
- Parameter names equal transformers' (`model.layers.N.self_attn.o_proj.weight`, ...) except
  the fused `qkv_proj` / `gate_up_proj`, described by `weight_mapping()`.
- With tied embeddings there is no `lm_head` parameter: logits use the embedding matrix.
- `forward` returns the hidden state after the final norm for every input row; the caller
  chooses which rows become logits. `forward_for_mtp` also returns the residual stream before
  that norm, which the MTP head (`self.mtp`, present when the config has
  `num_nextn_predict_layers` and the checkpoint its `mtp.*` tensors) reads.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from metrale.kernels import KernelOps
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.common import (
    GatedMLP,
    LayerCache,
    LayerCaches,
    PagedSelfAttention,
    PreNormLayer,
    RMSNorm,
)
from metrale.layers.rotary import RotaryEmbedding
from metrale.model_config import ModelConfig
from metrale.models.loader import WeightMapping, dense_weight_mapping
from metrale.models.mtp import MtpHead


class DecoderLayer(PreNormLayer):
    def __init__(
        self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, ops: KernelOps
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = PagedSelfAttention(cfg, layer_idx, rotary, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = self.build_mlp(cfg, layer_idx, ops)
        if isinstance(self.mlp, GatedMLP):
            self.self_attn.prefetch_mlp = (self.mlp,)

    def build_mlp(self, cfg: ModelConfig, layer_idx: int, ops: KernelOps) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act, ops)

    def mix(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, cache: LayerCache
    ) -> torch.Tensor:
        assert cache is not None
        return self.self_attn(positions, x, meta, cache)


class DecoderStack(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.layers = nn.ModuleList(
            [self.layer_class(cfg, i, self.rotary, ops) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: LayerCaches
    ) -> Tensor:
        return self.run(input_ids, positions, meta, kv_caches)[0]

    def run(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: LayerCaches
    ) -> tuple[Tensor, Tensor]:
        """`(after the final norm, the residual stream before it)` for every row."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, meta, kv)
        assert residual is not None
        return self.norm.forward_add(hidden, residual)


class DenseMtpHead(MtpHead):
    """The dense family's MTP head (the bundled model's layout): RMSNorms and decoder layers
    of the main stack's kind, reading the hidden state before the final norm."""

    hidden_before_norm = True

    def __init__(
        self,
        cfg: ModelConfig,
        num_layers: int,
        layer_class: type[DecoderLayer],
        rotary: RotaryEmbedding,
        ops: KernelOps,
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, ops)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, ops)
        # Built like the last main layer (its attention window, its MLP kind).
        last = cfg.num_hidden_layers - 1
        self.layers = nn.ModuleList(
            [layer_class(cfg, last, rotary, ops) for _ in range(num_layers)]
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    stack_class: type[DecoderStack] = DecoderStack

    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.stack_class(cfg, ops, max_positions)
        self.ops = ops
        self.tied = cfg.tie_word_embeddings
        if not self.tied:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        mtp_layers = int(cfg.raw.get("num_nextn_predict_layers") or 0)
        if mtp_layers:
            stack = self.model
            self.mtp = DenseMtpHead(cfg, mtp_layers, stack.layer_class, stack.rotary, ops)

    @property
    def has_mtp(self) -> bool:
        return hasattr(self, "mtp")

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def kv_layer_count(self) -> int:
        """How many layers hold paged KV (one `(k, v)` pair each, in layer order)."""
        return self.config.num_hidden_layers

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: LayerCaches
    ) -> Tensor:
        return self.model(input_ids, positions, meta, kv_caches)

    def forward_for_mtp(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: LayerCaches
    ) -> tuple[Tensor, Tensor]:
        """`(hidden after the final norm, the hidden the MTP head reads)` for every row."""
        return self.model.run(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return self.ops.linear(hidden, weight)

    def weight_mapping(self) -> WeightMapping:
        mapping = dense_weight_mapping(self.config, self.tied)
        if self.has_mtp:
            mapping.optional_prefixes = ("mtp.",)
        return mapping

    def drop_optional_weights(self, prefixes: set[str]) -> None:
        """Remove the MTP head when the checkpoint has no `mtp.*` tensors."""
        if "mtp." in prefixes and self.has_mtp:
            del self.mtp
