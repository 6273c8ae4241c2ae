"""The normalised shape of a decoder checkpoint: `ModelConfig` and its `RopeConfig`.

Owner: models (the types sit below `layers/` so building blocks can read a model's shape
without importing the architectures; `metrale.models.config` parses a `config.json` into
them and re-exports them).

Invariants:
- Plain frozen dataclasses: no torch, no I/O; only `metrale.models.config.parse_model_config`
  builds them from a checkpoint, so the two config layouts are handled in one place.
- `head_dim * num_attention_heads` need not equal `hidden_size` (explicit `head_dim` wins);
  `rotary_dim` is the part of `head_dim` that rotates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either config layout."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    #: Fraction of `head_dim` that rotates (1.0: all of it).
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """The shape and hyper-parameters of a decoder checkpoint."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    hidden_act: str = "silu"
    attention_bias: bool = False
    #: Bias on o_proj too (Llama's `attention_bias` covers it; Qwen2 biases only q/k/v).
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    #: Per layer: the attention window in tokens (including the current one), or None.
    sliding_windows: tuple[int | None, ...] = ()
    dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)
