"""An M2M100 / NLLB checkpoint's `config.json`: `M2M100Config` (parsed and checked),
`is_encoder_decoder_dir` (which checkpoints the translation path serves), and the
activations the model supports.

Owner: models. Invariants:
- An `M2M100Config` that exists can be built: an unknown `model_type` or activation, a
  missing size or heads that do not divide `d_model` raise a `CheckpointError` naming it.
- A key the file leaves out takes the default written in `from_dict`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from metrale.errors import CheckpointError

#: `model_type` values served by this module.
ENCDEC_MODEL_TYPES = frozenset({"m2m_100", "nllb"})
ARCHITECTURE = "M2M100ForConditionalGeneration"

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass(frozen=True)
class M2M100Config:
    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    activation_function: str
    scale_embedding: bool
    pad_token_id: int
    eos_token_id: int
    bos_token_id: int
    decoder_start_token_id: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> M2M100Config:
        model_type = raw.get("model_type")
        if model_type not in ENCDEC_MODEL_TYPES:
            raise CheckpointError(f"model_type {model_type!r} is not an M2M100/NLLB model")
        if raw.get("activation_function", "relu") not in ACTIVATIONS:
            raise CheckpointError(
                f"activation_function {raw.get('activation_function')!r} is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})"
            )
        for key in ("vocab_size", "d_model", "encoder_layers", "decoder_layers"):
            if key not in raw:
                raise CheckpointError(f"config.json of an M2M100 model lacks {key!r}")
        heads_e = int(raw.get("encoder_attention_heads", 16))
        heads_d = int(raw.get("decoder_attention_heads", 16))
        d = int(raw["d_model"])
        if d % heads_e or d % heads_d:
            raise CheckpointError(f"d_model {d} is not divisible by the attention head counts")
        eos = raw.get("eos_token_id", 2)
        return cls(
            vocab_size=int(raw["vocab_size"]),
            d_model=d,
            encoder_layers=int(raw["encoder_layers"]),
            decoder_layers=int(raw["decoder_layers"]),
            encoder_attention_heads=heads_e,
            decoder_attention_heads=heads_d,
            encoder_ffn_dim=int(raw.get("encoder_ffn_dim", 4 * d)),
            decoder_ffn_dim=int(raw.get("decoder_ffn_dim", 4 * d)),
            activation_function=str(raw.get("activation_function", "relu")),
            scale_embedding=bool(raw.get("scale_embedding", False)),
            pad_token_id=int(raw.get("pad_token_id", 1)),
            eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
            bos_token_id=int(raw.get("bos_token_id", 0)),
            decoder_start_token_id=int(raw.get("decoder_start_token_id", 2)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 1024)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            raw=raw,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> M2M100Config:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: cannot read config.json ({exc})") from exc
        return cls.from_dict(raw)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads


def is_encoder_decoder_dir(model_dir: str | Path) -> bool:
    """Whether `model_dir`'s config.json names an M2M100/NLLB model."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type") in ENCDEC_MODEL_TYPES
    except (OSError, json.JSONDecodeError):
        return False
