"""What loading a checkpoint needs before (and beside) building the model: the device, the
model dtype and the KV pool dtype from their config names, the checkpoint's float8 KV scales,
constructing parameters directly in a dtype, and random weights for `--load-format dummy`.

Owner: model-engine (used by `factory` for the target model and `draft_factory` for a draft).

Invariants:
- A name that is not a known device, dtype or KV dtype is an `InvalidRequestError` naming it.
- `default_dtype` restores the previous torch default dtype on every exit path.
- Checkpoint KV scales cover every KV layer or none, each finite and > 0, else a
  `CheckpointError` naming the checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from metrale.errors import CheckpointError, InvalidRequestError
from metrale.layers.common import AttentionProjections
from metrale.models.loader import checkpoint_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(
            "device 'cuda' was asked for but no CUDA device is available", param="device"
        )
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


#: `kv_cache_dtype` values that store float8 E4M3 (vLLM's "fp8" and "fp8_e4m3").
FP8_KV_NAMES = ("fp8", "fp8_e4m3")
#: Checkpoint tensor names (after the attention module's name) of float8 KV scales; vLLM's
#: names. `kv_scale` is one scale for both K and V (older checkpoints).
KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "kv_scale")


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool dtype of `kv_cache_dtype` `name`: the model dtype for "auto", float8 E4M3
    for "fp8" / "fp8_e4m3"; anything else is an `InvalidRequestError`."""
    if name == "auto":
        return dtype
    if name in FP8_KV_NAMES:
        return torch.float8_e4m3fn
    raise InvalidRequestError(
        f"kv_cache_dtype '{name}' is not one of auto, {', '.join(FP8_KV_NAMES)}",
        param="kv_cache_dtype",
    )


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How logs and reports name a KV dtype: "bfloat16", "float32", "fp8_e4m3"."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


def checkpoint_kv_scales(
    module: torch.nn.Module, model_dir: str, num_layers: int, mapping: Any = None
) -> torch.Tensor | None:
    """The checkpoint's float8 KV scales as `[num_layers, 2]` float32 (K, V), matched to the
    KV pool's layers through the attention modules' names in KV order (`<name>.k_scale`,
    `<name>.v_scale`, or one `<name>.kv_scale` for both); None when the checkpoint has none.
    Scales for some layers only, or for modules the pool does not hold, are a
    `CheckpointError`."""
    from safetensors import safe_open

    rename = getattr(mapping, "rename", None)
    found: dict[str, float] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.rsplit(".", 1)[-1] in KV_SCALE_SUFFIXES:
                    value = f.get_tensor(key).float()
                    if value.numel() != 1:
                        raise CheckpointError(
                            f"{path}: KV scale '{key}' has {value.numel()} elements; only "
                            "per-tensor KV scales are supported"
                        )
                    found[rename(key) if rename else key] = float(value.reshape(()))
    if not found:
        return None
    every = [n for n, m in module.named_modules() if isinstance(m, AttentionProjections)]
    # Attention modules past the pool's layers (an MTP head not drafting) keep no KV: their
    # scales are known names, not used.
    names = every[:num_layers]
    scales = torch.ones((num_layers, 2), dtype=torch.float32)
    used = set()
    for i, name in enumerate(names):
        both = found.get(f"{name}.kv_scale")
        k, v = found.get(f"{name}.k_scale", both), found.get(f"{name}.v_scale", both)
        if k is None or v is None:
            raise CheckpointError(
                f"{model_dir}: the checkpoint has KV scales but none for attention layer "
                f"'{name}' (k_scale and v_scale, or kv_scale); all layers or none"
            )
        scales[i, 0], scales[i, 1] = k, v
        used.update(f"{name}.{s}" for s in KV_SCALE_SUFFIXES)
    unused = {f"{n}.{s}" for n in every[num_layers:] for s in KV_SCALE_SUFFIXES}
    if len(names) != num_layers or set(found) - used - unused:
        extra = sorted(set(found) - used - unused)[:3]
        raise CheckpointError(
            f"{model_dir}: KV scales {extra or sorted(found)[:3]} do not match the model's "
            f"{num_layers} KV layers"
        )
    if not bool((scales > 0).all()) or not bool(torch.isfinite(scales).all()):
        raise CheckpointError(f"{model_dir}: KV scales must be finite and > 0")
    return scales


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Construct parameters directly in `dtype` (restores the previous default after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def dummy_init(module: torch.nn.Module) -> None:
    """Small random weights that keep activations finite in any dtype (`--load-format dummy`)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(module.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # drawn where the parameter lives: an 8B model initialises in seconds
                gen = torch.Generator(device=p.device).manual_seed(i)
                p.uniform_(-0.02, 0.02, generator=gen)
