"""Rotary position embedding: inverse frequencies for each supported scaling kind, and a
cos/sin table indexed by absolute position.

Owner: layers. The formulas follow the published definitions (RoPE, linear position
interpolation, Llama-3 frequency smoothing, YaRN) as transformers applies them, so that float32
outputs match it to rounding.

Invariants:
- The cos/sin cache is computed in float32 from float32 inverse frequencies and covers
  `max_positions`; it grows (never shrinks) if a longer position is asked for.
- Rotation uses the "rotate half" layout (first half pairs with second half of the rotary
  dims); dims past `rotary_dim` pass through unchanged.
"""

from __future__ import annotations

import math

import torch

from metrale.kernels import reference
from metrale.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq [rotary_dim // 2], attention_scaling)` for a rope configuration."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    scaling = 1.0
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq, scaling = _yarn(rope, rotary_dim)
    return inv_freq, scaling


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor = rope.factor
    low = rope.low_freq_factor if rope.low_freq_factor is not None else 1.0
    high = rope.high_freq_factor if rope.high_freq_factor is not None else 4.0
    old_len = rope.original_max_position_embeddings or 8192
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    original = rope.original_max_position_embeddings or 4096
    if rope.attention_factor is not None:
        attention = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        attention = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embedding to query and key rows by absolute position."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        inv_freq, self.attention_scaling = inverse_frequencies(rope, self.rotary_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("cos_sin", self._table(max_positions), persistent=False)

    def _table(self, n: int) -> torch.Tensor:
        positions = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]
        # [n, 2, rotary_dim // 2]: cos then sin, already scaled.
        return torch.stack((freqs.cos(), freqs.sin()), dim=1) * self.attention_scaling

    def ensure_positions(self, n: int) -> None:
        if n > self.cos_sin.shape[0]:
            self.cos_sin = self._table(max(n, 2 * self.cos_sin.shape[0]))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k `[T, Hk, D]`, positions `[T]` -> rotated q, k (same dtypes): the
        torch reference op, `reference.rotary_embedding`, over this layer's table."""
        return reference.rotary_embedding(positions, q, k, self.cos_sin, self.rotary_dim)
