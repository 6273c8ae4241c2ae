"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE: the vision towers (`qwen_vl_vision.py`, with the
checkpoint's `vision_config`) on the dense or MoE decoder, multimodal rotary positions (M-RoPE, contiguous or interleaved sections) and the embedding
merge at the image pad tokens, on the dense decoder (`llama.py`: Qwen2 layout for 2.5, Qwen3
with q/k norm for 3).

Owner: models. Written from the published architecture; parameter names equal the checkpoint's
(`visual.blocks.N.attn.qkv.weight`, `model.layers.N...`, `lm_head.weight`) except the fused
`gate_up_proj` of the decoder and of the vision MLPs, which `weight_mapping()` describes.

Invariants:
- `encode_images(pixel_values, grids)` returns one `[tokens_i, hidden]` tensor per image (or
  video), `tokens_i = t * h * w / merge**2`, in the order given; images never attend to each
  other (full-attention blocks attend within one frame, window blocks within one window of
  one frame), so encoding images together or apart gives the same rows.
- `forward(input_ids, positions, ...)` takes `positions` `[T]` (text: every M-RoPE stream
  equal, which is plain rotary) or `[3, T]` (temporal, height, width streams); `vision_rows`
  `(row_index [K], embeddings [K, hidden])` replaces those rows' token embeddings before the
  first layer; their DeepStack parts (Qwen3-VL: the row's columns past `hidden`, one block
  per level) are added to the outputs of decoder layers 0, 1, ... at the same rows. The rotary
  table swap for `[3, T]` lasts one forward (restored on every exit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from metrale.errors import CheckpointError
from metrale.kernels import KernelOps
from metrale.kernels.metadata import AttentionMetadata
from metrale.layers.common import LayerCaches
from metrale.layers.moe import SparseMoeBlock
from metrale.model_config import ModelConfig
from metrale.models.llama import DecoderStack, LlamaForCausalLM
from metrale.models.loader import StackedShard, WeightMapping
from metrale.models.moe import Qwen3MoeDecoderLayer, qwen3_moe_experts
from metrale.models.qwen_vl_vision import (
    Qwen3VisionTower,
    VisionTower,
    parse_vision_config,
)

# ---------------------------------------------------------------------------- M-RoPE


def mrope_table(
    cos_sin: torch.Tensor, positions: torch.Tensor, streams: torch.Tensor
) -> torch.Tensor:
    """Per-token `[T, 2, rotary_dim // 2]` cos/sin rows: frequency band `j` of the rotary
    dims takes the angle of position stream `streams[j]` (0 temporal, 1 height, 2 width)."""
    bands = cos_sin.shape[-1]
    if streams.shape[0] != bands:
        raise ValueError(f"{streams.shape[0]} M-RoPE band streams for {bands} bands")
    t = positions.shape[1]
    gathered = cos_sin.index_select(0, positions.reshape(-1)).view(3, t, 2, bands)
    index = streams.view(1, 1, 1, bands).expand(1, t, 2, bands)
    return gathered.gather(0, index)[0]


class VisionDecoderStack(DecoderStack):
    """The dense decoder with token-embedding overrides and per-token M-RoPE tables."""

    #: `[rotary_dim // 2]` int64: the M-RoPE stream of each frequency band (set by the model).
    mrope_streams: torch.Tensor
    #: Decoder hidden size (the width of one part of a vision row, see `run_vision`).
    deepstack_layers: int = 0

    def run_vision(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
        vision_rows: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        width = hidden.shape[-1]
        extra: list[torch.Tensor] = []
        if vision_rows is not None:
            index, rows = vision_rows
            rows = rows.to(hidden.dtype)
            hidden = hidden.index_copy(0, index, rows[:, :width])
            extra = [
                rows[:, width * (k + 1) : width * (k + 2)] for k in range(self.deepstack_layers)
            ]
        rotary = self.rotary
        base = rotary.cos_sin
        if positions.dim() == 2:
            rotary.ensure_positions(int(positions.max()) + 1)
            base = rotary.cos_sin
            rotary.cos_sin = mrope_table(base, positions, self.mrope_streams.to(positions.device))
            positions = torch.arange(positions.shape[1], device=positions.device)
        try:
            residual: torch.Tensor | None = None
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
                hidden, residual = layer(positions, hidden, residual, meta, kv)
                if i < len(extra):  # DeepStack: the tower's block-k features join layer k's output
                    hidden = hidden.index_add(0, vision_rows[0], extra[i])  # type: ignore[index]
        finally:
            rotary.cos_sin = base
        assert residual is not None
        return self.norm.forward_add(hidden, residual)[0]


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2.5-VL: `visual` (the tower) + the Qwen2 decoder (`model`) + `lm_head`."""

    stack_class = VisionDecoderStack
    tower_class: type[nn.Module] = VisionTower

    def __init__(self, cfg: ModelConfig, ops: KernelOps, max_positions: int) -> None:
        super().__init__(cfg, ops, max_positions)
        self.vision_config = parse_vision_config(cfg.raw)
        if self.vision_config.out_hidden_size != cfg.hidden_size:
            raise CheckpointError(
                f"vision_config.out_hidden_size {self.vision_config.out_hidden_size} differs from "
                f"the decoder's hidden_size {cfg.hidden_size}"
            )
        if sum(self.vision_config.mrope_section) * 2 != cfg.rotary_dim:
            raise CheckpointError(
                f"mrope_section {list(self.vision_config.mrope_section)} does not split "
                f"rotary_dim {cfg.rotary_dim}"
            )
        assert isinstance(self.model, VisionDecoderStack)
        streams = self.vision_config.band_streams(cfg.rotary_dim // 2)
        self.model.mrope_streams = torch.tensor(streams, dtype=torch.int64)
        self.model.deepstack_layers = len(self.vision_config.deepstack_visual_indexes)
        self.visual = self.tower_class(self.vision_config, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: LayerCaches,
        vision_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        stack = self.model
        assert isinstance(stack, VisionDecoderStack)
        return stack.run_vision(input_ids, positions, meta, kv_caches, vision_rows)

    def encode_images(
        self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]
    ) -> list[torch.Tensor]:
        """One `[tokens_i, hidden * (1 + deepstack layers)]` tensor per image: the merged
        rows, then (Qwen3-VL) each DeepStack level's rows, side by side."""
        merged = self.visual(pixel_values, grids)
        sizes = [t * h * w // self.vision_config.merge_unit for t, h, w in grids]
        return list(merged.split(sizes))

    def weight_mapping(self) -> WeightMapping:
        """The decoder's mapping, plus the tower's gate/up tensors (renamed to parts of their
        own: they are sized by the tower's intermediate size) fused into `gate_up_proj`."""
        mapping = super().weight_mapping()
        rows = self.vision_config.intermediate_size
        mapping.stacked = [
            StackedShard("gate_up_proj", "vision_gate_proj", 0, rows),
            StackedShard("gate_up_proj", "vision_up_proj", rows, rows),
            *mapping.stacked,
        ]
        mapping.rename = _checkpoint_name
        return mapping


def _checkpoint_name(name: str) -> str:
    """transformers 5 may save `model.language_model.*` / `model.visual.*`, published
    checkpoints hold `model.*` / `visual.*`: both read as the latter; the tower's MLP
    `gate_proj` / `up_proj` become `vision_gate_proj` / `vision_up_proj`."""
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    elif name.startswith("model.visual."):
        name = name.removeprefix("model.")
    if name.startswith("visual."):
        name = name.replace(".mlp.gate_proj.", ".mlp.vision_gate_proj.")
        name = name.replace(".mlp.up_proj.", ".mlp.vision_up_proj.")
    return name


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen3-VL (dense): Qwen3's decoder (q/k norm), interleaved M-RoPE, the Qwen3 tower with
    DeepStack features added after the first decoder layers."""

    tower_class = Qwen3VisionTower


class Qwen3VLMoeDecoderLayer(Qwen3MoeDecoderLayer):
    """Qwen3-MoE's layer; Qwen3-VL-MoE's router always renormalises over the chosen experts
    (its config has no `norm_topk_prob`)."""

    def build_mlp(self, cfg: ModelConfig, layer_idx: int, ops: KernelOps) -> nn.Module:
        mlp = super().build_mlp(cfg, layer_idx, ops)
        if isinstance(mlp, SparseMoeBlock):
            mlp = SparseMoeBlock(replace(mlp.gate.spec, renormalize=True), ops)
        return mlp


class VisionMoeStack(VisionDecoderStack):
    layer_class = Qwen3VLMoeDecoderLayer


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: the Qwen3-VL tower and M-RoPE on the Qwen3-MoE decoder (`moe.py`)."""

    stack_class = VisionMoeStack

    def weight_mapping(self) -> WeightMapping:
        mapping = super().weight_mapping()
        mapping.experts = qwen3_moe_experts(self.config)
        return mapping
