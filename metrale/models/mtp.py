"""Multi-token-prediction (MTP) heads: the `mtp.*` layers a checkpoint carries beside its main
model (Qwen3-Next, the bundled `metrale-tiny-code`, DeepSeek-style `num_nextn_predict_layers`),
run by the model engine as a draft proposer.

Owner: models. The model engine (`metrale/model_engine/mtp.py`) feeds the head and keeps its
KV; this module only computes.

Invariants:
- Row i of a head's input pairs the main model's hidden state at position i with the
  embedding of token i + 1; the head's attention runs at RoPE position i over its own paged KV
  (one extra KV layer per head layer) and its logits predict token i + 2:
  `z = fc([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])`, the decoder layers, `norm`,
  then the main model's LM head. Embedding and LM head are the main model's.
- `hidden_before_norm` says which hidden state the head reads: the residual stream before the
  main model's final norm (the bundled model's recipe, the seed's convention) or after it
  (Qwen3-Next, as vLLM serves it). A head recursing for a second draft feeds back its own
  hidden state of the same kind: the stream before its `norm`, or after it.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.common import LayerCaches


class MtpHead(nn.Module):
    """`fc` over `[norm(embedding), norm(hidden)]`, decoder layers, a final norm. Subclasses
    build the norms and layers of their architecture under the checkpoint's names."""

    pre_fc_norm_embedding: nn.Module
    pre_fc_norm_hidden: nn.Module
    fc: nn.Linear
    layers: nn.ModuleList
    norm: nn.Module
    #: Whether the head reads the main model's hidden state before its final norm.
    hidden_before_norm: bool = True

    @property
    def kv_layer_count(self) -> int:
        return len(self.layers)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(normed, next_hidden)`: the rows to take logits of, and the hidden state a further
        draft step reads (see the invariants)."""
        z = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden.to(embeds.dtype))],
            dim=-1,
        )
        z = self.fc(z)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            z, residual = layer(positions, z, residual, meta, kv)
        assert residual is not None
        normed, summed = self.norm.forward_add(z, residual)
        return normed, summed if self.hidden_before_norm else normed
