"""Qwen2.5-VL's and Qwen3-VL's vision side: the `vision_config` of a checkpoint
(`VisionConfig`, `parse_vision_config`) and the two vision towers: Qwen2.5-VL's (patch
embedding, window / full attention blocks, patch merger) and Qwen3-VL's (learned positions
interpolated to each grid, DeepStack mergers).

Owner: models. Parameter names equal the checkpoint's below `visual.` (the fused vision MLP
`gate_up_proj` of Qwen2.5-VL aside, which the model's `weight_mapping()` describes).

Invariants:
- A tower's `forward(pixels, grids)` returns the rows of the images in the order given,
  `t * h * w / merge**2` per image; images never attend to each other (full-attention blocks
  attend within one frame, window blocks within one window of one frame), so encoding images
  together or apart gives the same rows.
- `parse_vision_config` refuses a `vision_config` it cannot serve with a `CheckpointError`
  that says what is missing or wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from metrale.errors import CheckpointError
from metrale.kernels import KernelOps
from metrale.layers.common import GatedMLP, RMSNorm


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape and the token ids that carry vision into the prompt."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    out_hidden_size: int
    in_channels: int
    hidden_act: str
    tokens_per_second: float
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    #: The decoder's M-RoPE split of the rotary frequencies into (t, h, w) sections.
    mrope_section: tuple[int, int, int]
    #: Qwen3-VL: the sections interleave (t, h, w, t, h, w, ...) instead of being contiguous.
    mrope_interleaved: bool = False
    #: Qwen3-VL: a learned position table of this many entries (a square grid), resampled
    #: bilinearly to each image's patch grid; 0: none (Qwen2.5-VL).
    num_position_embeddings: int = 0
    #: Qwen3-VL (DeepStack): tower blocks whose merged output is added to the decoder's hidden
    #: states at the image rows after decoder layers 0, 1, ...
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def timestamped_video(self) -> bool:
        """Qwen3-VL lays a video out as timestamped frames (not built here); Qwen2.5-VL as
        one grid with temporal positions."""
        return self.mrope_interleaved

    def band_streams(self, bands: int) -> list[int]:
        """For each rotary frequency band, the M-RoPE stream it reads (0 t, 1 h, 2 w)."""
        t, h, w = self.mrope_section
        if self.mrope_interleaved:
            return [
                1 if j % 3 == 1 and j < 3 * h else 2 if j % 3 == 2 and j < 3 * w else 0
                for j in range(bands)
            ]
        return [0] * t + [1] * h + [2] * w

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


def parse_vision_config(raw: dict[str, Any], source: str = "config.json") -> VisionConfig:
    """The vision part of a Qwen2.5-VL `config.json` (either layout: `text_config` nested,
    transformers 5, or the text fields at the top level, as published checkpoints have)."""
    vision = raw.get("vision_config")
    if not isinstance(vision, dict):
        raise CheckpointError(f"{source}: a vision-language checkpoint needs 'vision_config'")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = dict(text.get("rope_parameters") or {})
    for key, value in (text.get("rope_scaling") or raw.get("rope_scaling") or {}).items():
        rope.setdefault(key, value)
    section = rope.get("mrope_section")
    if not isinstance(section, list) or len(section) != 3:
        raise CheckpointError(f"{source}: the text rope parameters lack a 3-entry 'mrope_section'")
    vrope = vision.get("rope_parameters") or {}

    def tok(name: str) -> int:
        value = raw.get(name, text.get(name))
        if value is None:
            raise CheckpointError(f"{source}: config.json lacks '{name}'")
        return int(value)

    try:
        return VisionConfig(
            depth=int(vision["depth"]),
            hidden_size=int(vision["hidden_size"]),
            num_heads=int(vision["num_heads"]),
            intermediate_size=int(vision["intermediate_size"]),
            patch_size=int(vision.get("patch_size", 14)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            window_size=int(vision.get("window_size", 112)),
            fullatt_block_indexes=tuple(int(i) for i in vision.get("fullatt_block_indexes", ())),
            out_hidden_size=int(vision.get("out_hidden_size", vision["hidden_size"])),
            in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            hidden_act=str(vision.get("hidden_act", "silu")),
            tokens_per_second=float(vision.get("tokens_per_second", 2)),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
            image_token_id=tok("image_token_id"),
            video_token_id=tok("video_token_id"),
            vision_start_token_id=tok("vision_start_token_id"),
            vision_end_token_id=tok("vision_end_token_id"),
            mrope_section=(int(section[0]), int(section[1]), int(section[2])),
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            num_position_embeddings=int(vision.get("num_position_embeddings") or 0),
            deepstack_visual_indexes=tuple(
                int(i) for i in vision.get("deepstack_visual_indexes") or ()
            ),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: vision_config lacks {exc}") from exc


# ------------------------------------------------------------------------- vision tower


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention within segments (windows or frames) of the packed patch rows."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        cos_, sin_ = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * cos_ + _rotate_half(q.float()) * sin_).to(x.dtype)
        k = (k.float() * cos_ + _rotate_half(k.float()) * sin_).to(x.dtype)
        out = torch.empty_like(q)
        # Segments of one length run as one batched SDPA call (most windows are full-size).
        starts = [0]
        for length in segments:
            starts.append(starts[-1] + length)
        by_len: dict[int, list[int]] = {}
        for i, length in enumerate(segments):
            by_len.setdefault(length, []).append(starts[i])
        for length, firsts in by_len.items():
            index = (
                torch.tensor(firsts, device=x.device)[:, None]
                + torch.arange(length, device=x.device)[None, :]
            ).reshape(-1)
            b = len(firsts)
            shape = (b, length, self.num_heads, self.head_dim)
            qs, ks, vs = (t.index_select(0, index).view(shape).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs)
            out.index_copy_(0, index, o.transpose(1, 2).reshape(b * length, self.num_heads, -1))
        return self.proj(out.reshape(n, -1))


class _PreNormBlock(nn.Module):
    """A vision block's residual order: attention over `norm1(x)`, then the MLP over
    `norm2(x)`, each added to the stream (the norms and MLP are the tower's kind)."""

    norm1: nn.Module
    norm2: nn.Module
    attn: VisionAttention
    mlp: nn.Module

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class VisionBlock(_PreNormBlock):
    def __init__(self, cfg: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6, ops)
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6, ops)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, True, cfg.hidden_act, ops)


class PatchEmbed(nn.Module):
    """A `(temporal, patch, patch)` convolution with stride equal to its kernel: one matrix
    product over each flattened patch (the checkpoint's `Conv3d` weight, kept in its shape)."""

    def __init__(self, cfg: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.hidden_size, cfg.in_channels, t, p, p))
        self.proj.bias = nn.Parameter(torch.empty(cfg.hidden_size)) if bias else None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6, ops)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


def vision_rotary_positions(grids: Sequence[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """`[patches, 2]` (row, column) of every patch, in the processor's merge-block-major
    order (each `merge x merge` block's patches are consecutive), frames repeated."""
    out = []
    for t, h, w in grids:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        pos = torch.stack(
            [rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1
        )
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def rope_inv_freq(cfg: VisionConfig) -> torch.Tensor:
    """The towers' rotary inverse frequencies: `head_dim / 4` of them, applied to each of the
    two position streams of `vision_rotary_positions`."""
    spatial = cfg.hidden_size // cfg.num_heads // 2
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


def rope_angles(
    grids: Sequence[tuple[int, int, int]], merge: int, inv_freq: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """`[patches, head_dim]` rotary angles of every patch: the first position stream's
    angles, then the second's, the pair repeated for `rotate_half`."""
    pos = vision_rotary_positions(grids, merge).to(device)
    freqs = pos[..., None].float() * inv_freq  # [n, 2, head_dim / 4]
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    return torch.cat([freqs, freqs], dim=-1)


def window_order(
    grids: Sequence[tuple[int, int, int]], merge: int, window: int
) -> tuple[torch.Tensor, list[int]]:
    """`(order, window lengths)`: merged-token indices regrouped so each attention window's
    tokens are consecutive (windows of `window x window` merged tokens, row-major within a
    frame, the frame's edge windows smaller), and each window's length in patches."""
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    base = 0
    unit = merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw) + base
        for f in range(t):
            for r0 in range(0, gh, window):
                for c0 in range(0, gw, window):
                    cell = index[f, r0 : r0 + window, c0 : c0 + window].reshape(-1)
                    order.append(cell)
                    lengths.append(cell.numel() * unit)
        base += t * gh * gw
    return torch.cat(order), lengths


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg, ops) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, ops)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """`pixels` `[patches, C*T*p*p]` of every image in order -> `[merged tokens, out]`."""
        cfg = self.cfg
        unit = cfg.merge_unit
        x = self.patch_embed(pixels)
        n = x.shape[0]
        expected = sum(t * h * w for t, h, w in grids)
        if n != expected:
            raise ValueError(f"{n} patch rows for grids {list(grids)} ({expected} expected)")
        window = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        order, window_lens = window_order(grids, cfg.spatial_merge_size, max(window, 1))
        order = order.to(x.device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        angles = rope_angles(grids, cfg.spatial_merge_size, self.inv_freq, x.device)

        def permute(t: torch.Tensor) -> torch.Tensor:
            return t.view(n // unit, unit, -1).index_select(0, order).reshape(n, -1)

        x = permute(x)
        cos, sin = permute(angles.cos()), permute(angles.sin())
        full = set(cfg.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in full else window_lens)
        merged = self.merger(x)
        return merged.index_select(0, torch.argsort(order))


class Qwen3VisionMlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise CheckpointError(f"vision hidden_act '{cfg.hidden_act}' is not supported")
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class Qwen3VisionBlock(_PreNormBlock):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = Qwen3VisionMlp(cfg)


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (before the 2x2 merge, or after it for the DeepStack mergers), then
    `fc1 -> GELU -> fc2` over each merged group."""

    def __init__(self, cfg: VisionConfig, post_shuffle_norm: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.merge_unit
        self.post_shuffle_norm = post_shuffle_norm
        self.norm = nn.LayerNorm(self.width if post_shuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.post_shuffle_norm else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


def bilinear_taps(
    grids: Sequence[tuple[int, int, int]], merge: int, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(indices [patches, 4], weights [patches, 4])` resampling a `side x side` table to each
    image's patch grid (bilinear, corners aligned), patches in merge-block-major order."""
    idx, wts = [], []
    for t, h, w in grids:
        pos = vision_rotary_positions([(t, h, w)], merge)  # (row, col) per patch

        def axis(coord: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
            src = coord.float() * (side - 1) / max(size - 1, 1)
            lo = src.floor()
            taps = torch.stack([lo, lo + 1], dim=1)
            weight = (1 - (src[:, None] - taps).abs()).clamp(min=0)
            return taps.long().clamp(0, side - 1), weight

        rt, rw = axis(pos[:, 0], h)
        ct, cw = axis(pos[:, 1], w)
        idx.append((rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4))
        wts.append((rw[:, :, None] * cw[:, None, :]).reshape(-1, 4))
    return torch.cat(idx), torch.cat(wts)


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's tower: patch embedding plus a resampled learned position table, full
    attention within each frame in every block, the merger, and the DeepStack mergers."""

    def __init__(self, cfg: VisionConfig, ops: KernelOps) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = Qwen3PatchMerger(cfg, post_shuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            [Qwen3PatchMerger(cfg, post_shuffle_norm=True) for _ in cfg.deepstack_visual_indexes]
        )
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """`[merged tokens, out * (1 + DeepStack levels)]`: the merger's rows, then each level's."""
        cfg = self.cfg
        x = self.patch_embed(pixels)
        index, weight = bilinear_taps(grids, cfg.spatial_merge_size, self.side)
        pos = (self.pos_embed(index.to(x.device)) * weight.to(x.device)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        angles = rope_angles(grids, cfg.spatial_merge_size, self.inv_freq, x.device)
        cos, sin = angles.cos(), angles.sin()
        frames = [h * w for t, h, w in grids for _ in range(t)]
        levels: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in cfg.deepstack_visual_indexes:
                k = cfg.deepstack_visual_indexes.index(i)
                levels.append(self.deepstack_merger_list[k](x))
        return torch.cat([self.merger(x), *levels], dim=-1)
