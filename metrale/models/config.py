"""Reading a Hugging Face `config.json` into one normalised `ModelConfig`.

Owner: models. Every architecture reads its shape from a `ModelConfig` (defined, with
`RopeConfig`, in `metrale.model_config` below `layers/`, and re-exported here), never from the raw
dict, so the two layouts found in the wild are handled in one place:
- the classic layout of published checkpoints (top-level `rope_theta`, `rope_scaling`,
  `torch_dtype`), and
- the transformers 5 layout (`rope_parameters`, `dtype`).

Invariants:
- `head_dim * num_attention_heads` need not equal `hidden_size` (explicit `head_dim` wins).
- A config metrale cannot serve faithfully (unknown rope type, dynamic rope) is refused here
  with a `CheckpointError` that names the field; nothing is silently approximated.
- A vision-language config (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) describes its decoder here
  (`_text_part`); `raw` holds the decoder's fields at the top level and still the vision
  part.
- `raw` keeps the whole dict for family-specific fields (experts, SSM layout); the hybrid
  families read their layer layout from it in both forms (`hybrid_override_pattern` string or
  `layers_block_type` / `layer_types` lists), and the layer count follows that layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from metrale.errors import CheckpointError
from metrale.model_config import SUPPORTED_ROPE_TYPES, ModelConfig, RopeConfig

__all__ = [
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "RopeConfig",
    "parse_model_config",
    "parse_rope",
    "read_config_json",
]


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a checkpoint directory needs a config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _require(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw or raw[key] is None:
        raise CheckpointError(f"{source}: config.json lacks '{key}'")
    return raw[key]


def parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    """Rope parameters from `rope_parameters` (transformers 5) or top-level `rope_theta` and
    `rope_scaling` (classic)."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    merged: dict[str, Any] = {}
    if isinstance(params, dict):
        if any(isinstance(v, dict) for v in params.values()):
            raise CheckpointError(f"{source}: per-layer-type rope_parameters are not supported")
        merged.update(params)
    if isinstance(scaling, dict):
        for key, value in scaling.items():
            merged.setdefault(key, value)
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type == "dynamic":
        raise CheckpointError(
            f"{source}: rope type 'dynamic' changes frequencies with the batch's length, which "
            "breaks paged KV reuse; it is not supported"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"{source}: rope type '{rope_type}' is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0
    original = raw.get("original_max_position_embeddings") or merged.get(
        "original_max_position_embeddings"
    )
    if rope_type in ("llama3", "yarn") and original is None:
        original = raw.get("max_position_embeddings")
    factor = merged.get("factor")
    if rope_type in ("linear", "llama3") and factor is None:
        raise CheckpointError(f"{source}: rope type '{rope_type}' needs a 'factor'")
    if rope_type == "yarn" and factor is None:
        factor = float(raw["max_position_embeddings"]) / float(original)
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        partial_rotary_factor=float(partial),
        original_max_position_embeddings=int(original) if original is not None else None,
        low_freq_factor=merged.get("low_freq_factor"),
        high_freq_factor=merged.get("high_freq_factor"),
        beta_fast=merged.get("beta_fast"),
        beta_slow=merged.get("beta_slow"),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )


def _sliding_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Per-layer attention windows, as transformers decides them for these families."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return tuple(
            int(window) if t == "sliding_attention" and window else None for t in layer_types
        )
    if not window:
        return (None,) * num_layers
    model_type = raw.get("model_type", "")
    if model_type in ("qwen2", "qwen3"):
        # Qwen2/3 window only layers at or above max_window_layers, and only when enabled.
        if not raw.get("use_sliding_window", False):
            return (None,) * num_layers
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return (int(window),) * num_layers


def _num_layers(raw: dict[str, Any], source: str) -> int:
    """`num_hidden_layers`, except where a Nemotron-H-style block layout (`layers_block_type`
    list or `hybrid_override_pattern` string) defines the layers: its length wins, as in
    transformers (whose v5 configs of that family omit `num_hidden_layers`)."""
    for key in ("layers_block_type", "hybrid_override_pattern"):
        value = raw.get(key)
        if isinstance(value, (list, str)) and value:
            return len(value)
    return int(_require(raw, "num_hidden_layers", source))


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, list):
        return tuple(int(e) for e in eos)
    return (int(eos),)


#: Vision-language model types -> the decoder family whose flags their text model has.
MULTIMODAL_TEXT_TYPES = {
    "qwen2_5_vl": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_text": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
    "qwen3_vl_moe_text": "qwen3_moe",
}


def _text_part(raw: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config's decoder fields as a plain decoder config: `text_config`
    (transformers 5, lifted to the top level, the nested copy kept) or the top level
    (published checkpoints), under its decoder family's model type, with the M-RoPE rope type
    read as the default rotary (the model applies the sections); `vision_config` and the
    vision token ids stay. Other configs pass through unchanged."""
    model_type = raw.get("model_type")
    if model_type not in MULTIMODAL_TEXT_TYPES:
        return raw
    nested = raw.get("text_config")
    text = {**raw, **nested} if isinstance(nested, dict) else dict(raw)
    text["model_type"] = MULTIMODAL_TEXT_TYPES[str(model_type)]
    text["architectures"] = raw.get("architectures")
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if isinstance(rope, dict) and rope.get("type", rope.get("rope_type")) in (
            "mrope",
            "default",
        ):
            text[key] = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
    return text


def parse_model_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Normalise a decoder config dict; raises `CheckpointError` naming what is missing."""
    raw = _text_part(raw)
    archs = raw.get("architectures") or []
    model_type = str(_require(raw, "model_type", source))
    hidden = int(_require(raw, "hidden_size", source))
    heads = int(_require(raw, "num_attention_heads", source))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads != 0:
        raise CheckpointError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim = int(raw.get("head_dim") or raw.get("attention_head_dim") or hidden // heads)
    num_layers = _num_layers(raw, source)
    attention_bias = bool(raw.get("attention_bias", False))
    o_proj_bias = attention_bias
    if model_type == "qwen2":
        attention_bias, o_proj_bias = True, False
    act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    return ModelConfig(
        architecture=str(archs[0]) if archs else model_type,
        model_type=model_type,
        vocab_size=int(_require(raw, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", raw.get("layer_norm_epsilon", 1e-6))),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope=parse_rope(raw, source),
        hidden_act=str(act),
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "qwen3_next"),
        sliding_windows=_sliding_windows(raw, num_layers),
        dtype=raw.get("dtype") or raw.get("torch_dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
        raw=raw,
    )
