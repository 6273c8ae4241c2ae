"""Quantized checkpoints: which `quantization_config` a checkpoint may carry, and the FP8
weights it holds, either kept as stored (with their scales) or dequantized at load.

Owner: models (the factory parses the scheme; the loader streams tensors through
`dequantized`; `model_engine/fp8_weights.py` decides which weights stay FP8).

Invariants:
- A `quantization_config` this module does not implement is a start-up error naming the
  method (and what is supported), never a silent cast; so is a float8 tensor in a checkpoint
  without one, and a quantized weight whose scale is missing (or a scale without its weight).
- Supported, weights only: block-wise FP8 (`quant_method: fp8`, E4M3, `weight_block_size`,
  `weight_scale_inv` per block: Qwen3-*-FP8, DeepSeek), per-channel or per-tensor FP8
  (`fbgemm_fp8`, and `compressed-tensors` float 8-bit weights with `strategy` channel or
  tensor: `weight_scale`). Activations stay in the model dtype (a checkpoint's static
  `input_scale` is not used: W8A16, the matmuls run in higher precision than FP8 x FP8).
- What exists: on CUDA, a weight whose target parameter is FP8 (`keep`: the attention and
  MLP projections, `layers/fp8_linear.Fp8Linear`) is passed on as an `Fp8Weight` (weight and
  scale as stored, shapes checked) and runs through the FP8 kernels (`kernels/triton_fp8`);
  every other quantized weight (and every one on the CPU) is dequantized exactly (`fp8 *
  scale` in float32, `reference.dequantize_fp8`), then stored in the model's dtype, logged
  with its count. The online `--quantization fp8` path (float checkpoints) is
  `reference.quantize_fp8`, applied by `fp8_weights` after loading.
- Layers the config lists as not converted (`modules_to_not_convert`, `ignore`) arrive in the
  model dtype and pass through untouched (no scale: they are never made FP8).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.errors import CheckpointError
from metrale.kernels.reference import dequantize_fp8

logger = logging.getLogger(__name__)

SUPPORTED = ("fp8 (block-wise, weight_block_size)", "fbgemm_fp8", "compressed-tensors (fp8)")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class WeightQuant:
    """How a checkpoint's quantized weights are stored."""

    #: "block": `weight_scale_inv [ceil(out / bo), ceil(in / bi)]`; "channel":
    #: `weight_scale [out, 1]` (or `[out]`); "tensor": `weight_scale` of one element.
    kind: str
    #: The checkpoint's method name, for messages.
    method: str
    block: tuple[int, int] | None = None

    @property
    def scale_suffix(self) -> str:
        return "weight_scale_inv" if self.kind == "block" else "weight_scale"

    def describe(self) -> str:
        if self.kind == "block":
            return f"{self.method}: FP8 E4M3 weights, {self.block[0]}x{self.block[1]} block scales"  # type: ignore[index]
        return f"{self.method}: FP8 weights, per-{self.kind} scales"


def parse_quantization(raw: dict[str, Any], source: str) -> WeightQuant | None:
    """The checkpoint's weight quantization, None when it has none; an unsupported one is a
    `CheckpointError` naming the method."""
    config = raw.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: quantization_config is not an object")
    method = str(config.get("quant_method") or "").lower()
    refused = CheckpointError(
        f"{source}: quantization method {method or '(none named)'!r} is not supported "
        f"(supported: {', '.join(SUPPORTED)}); refusing to load rather than run the "
        "quantized weights without their scales"
    )
    if method == "fp8":
        block = config.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block
        )):  # fmt: skip
            raise CheckpointError(
                f"{source}: quant_method 'fp8' without a weight_block_size [rows, cols] "
                "(per-tensor fp8 of this method is not supported)"
            )
        if str(config.get("fmt", "e4m3")).lower() != "e4m3":
            raise CheckpointError(f"{source}: fp8 format {config.get('fmt')!r} is not supported")
        return WeightQuant("block", method, (block[0], block[1]))
    if method == "fbgemm_fp8":
        return WeightQuant("channel", method)
    if method == "compressed-tensors":
        groups = config.get("config_groups") or {}
        kinds = set()
        for name, group in groups.items():
            weights = (group or {}).get("weights") or {}
            if weights.get("num_bits") != 8 or weights.get("type") != "float":
                raise CheckpointError(
                    f"{source}: compressed-tensors group {name!r} stores "
                    f"{weights.get('num_bits')}-bit {weights.get('type')} weights; only 8-bit "
                    "float (fp8) weights are supported"
                )
            strategy = weights.get("strategy")
            if strategy not in ("channel", "tensor"):
                raise CheckpointError(
                    f"{source}: compressed-tensors weight strategy {strategy!r} is not "
                    "supported (channel or tensor)"
                )
            kinds.add(strategy)
        if len(kinds) != 1:
            raise CheckpointError(f"{source}: compressed-tensors config names no weight group")
        return WeightQuant(kinds.pop(), method)
    raise refused


def _validate(weight: torch.Tensor, scale: torch.Tensor, quant: WeightQuant) -> None:
    """A `ValueError` naming the problem when `scale` does not fit `weight` under `quant`."""
    if quant.kind == "block":
        bo, bi = quant.block  # type: ignore[misc]
        rows, cols = weight.shape
        need = (-(-rows // bo), -(-cols // bi))
        if tuple(scale.shape) != need:
            raise ValueError(f"block scales have shape {list(scale.shape)}, expected {list(need)}")
    elif quant.kind == "channel":
        if scale.numel() != weight.shape[0]:
            raise ValueError(
                f"channel scales have {scale.numel()} entries for {weight.shape[0]} rows"
            )
    elif scale.numel() != 1:
        raise ValueError(f"a per-tensor scale has {scale.numel()} entries")


def _dequantize(weight: torch.Tensor, scale: torch.Tensor, quant: WeightQuant) -> torch.Tensor:
    _validate(weight, scale, quant)
    if quant.kind == "block":
        return dequantize_fp8(weight, scale, quant.block)
    return dequantize_fp8(weight, scale.reshape(-1).expand(weight.shape[0]), None)


@dataclass(frozen=True)
class Fp8Weight:
    """A checkpoint's FP8 weight with its scale, passed to the loader as stored (for a
    parameter that stays FP8: `metrale.layers.fp8_linear.Fp8Linear`)."""

    weight: torch.Tensor
    scale: torch.Tensor
    quant: WeightQuant

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def row_scales(self, block: tuple[int, int] | None, rows: int) -> torch.Tensor:
        """This weight's scales in an `Fp8Linear`'s layout `block`: the checkpoint's block
        scales as stored, or (None) one float32 per row of its `rows` (a per-tensor scale
        repeated)."""
        s = self.scale.to(torch.float32)
        if block is None:
            if self.quant.kind == "block":
                raise ValueError("block scales cannot fill a per-row scale")
            return s.reshape(-1).expand(rows).contiguous()
        if self.quant.kind != "block" or self.quant.block != block:
            raise ValueError(f"{self.quant.describe()} cannot fill {block} block scales")
        return s


def dequantized(
    tensors: Iterator[tuple[str, torch.Tensor, Path]],
    quant: WeightQuant | None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | Fp8Weight, Path]]:
    """The checkpoint's tensors with every quantized weight replaced by its float32
    dequantization (its scale consumed), or, where `keep(name)`, by an `Fp8Weight` (weight
    and scale as stored); everything else unchanged. Pairs a weight with its scale in
    whatever order and shard they come."""
    waiting_weights: dict[str, tuple[torch.Tensor, Path]] = {}
    waiting_scales: dict[str, tuple[torch.Tensor, Path]] = {}
    count = kept = 0

    def paired(name: str, weight: torch.Tensor, scale: torch.Tensor, path: Path):
        nonlocal count, kept
        if keep is not None and keep(name):
            try:
                _validate(weight, scale, quant)  # type: ignore[arg-type]
            except ValueError as exc:
                raise CheckpointError(f"{path}: tensor '{name}': {exc}") from exc
            kept += 1
            return Fp8Weight(weight, scale, quant)  # type: ignore[arg-type]
        count += 1
        return _checked(name, weight, scale, quant, path)  # type: ignore[arg-type]

    for name, tensor, path in tensors:
        if quant is None:
            if tensor.dtype in FP8_DTYPES:
                raise CheckpointError(
                    f"{path}: tensor '{name}' is {tensor.dtype} but config.json has no "
                    "quantization_config to say how it is scaled"
                )
            yield name, tensor, path
            continue
        if name.endswith("." + quant.scale_suffix):
            base = name[: -len(quant.scale_suffix)] + "weight"
            if base in waiting_weights:
                weight, wpath = waiting_weights.pop(base)
                yield base, paired(base, weight, tensor, wpath), wpath
            else:
                waiting_scales[base] = (tensor, path)
            continue
        if name.endswith(".input_scale") or name.endswith(".input_scale_inv"):
            continue  # activation scales: activations stay in the model dtype
        if tensor.dtype in FP8_DTYPES:
            if name in waiting_scales:
                scale, _ = waiting_scales.pop(name)
                yield name, paired(name, tensor, scale, path), path
            else:
                waiting_weights[name] = (tensor, path)
            continue
        yield name, tensor, path
    if waiting_weights or waiting_scales:
        orphan = sorted(waiting_weights) or sorted(waiting_scales)
        what = "has no scale" if waiting_weights else "scales no weight"
        raise CheckpointError(
            f"quantized tensor '{orphan[0]}' {what} ({quant.scale_suffix if quant else ''}); "
            f"{len(waiting_weights) + len(waiting_scales)} such tensors in all"
        )
    if quant is not None and count:
        logger.warning(
            "%s: %d weights dequantized at load to the model dtype (they take its bytes, "
            "and their matmuls run in it)",
            quant.describe(), count,
        )  # fmt: skip
    if quant is not None and kept:
        logger.info("%s: %d weights kept in FP8 with their scales", quant.describe(), kept)


def _checked(
    name: str, weight: torch.Tensor, scale: torch.Tensor, quant: WeightQuant, path: Path
) -> torch.Tensor:
    try:
        return _dequantize(weight, scale, quant)
    except ValueError as exc:
        raise CheckpointError(f"{path}: tensor '{name}': {exc}") from exc
