"""Which weights a model keeps in FP8 at load, and the words that name its weight dtype.

Owner: model-engine (start-up). `load_model` asks `plan` once, converts the projections
before the weights load (an FP8 checkpoint: the loader fills them as stored) or after (online
`--quantization fp8`, and random `--load-format dummy` weights), and reports `describe`.

Invariants:
- FP8 compute exists on CUDA only. On the CPU an FP8 checkpoint is dequantized at load to the
  model dtype (logged by `quantization.dequantized`), and `--quantization fp8` is a start-up
  error (there is no FP8 CPU kernel to run it with).
- An FP8 checkpoint keeps its layout: block scales stay block scales (the kernels take power
  of two blocks >= 16; any other block is dequantized, logged), per-channel and per-tensor
  scales become one scale per output row. Only projections the checkpoint stores quantized
  are converted (a projection it lists as not converted, the lm_head and the embeddings stay
  in the model dtype).
- `--quantization fp8` on a float checkpoint quantizes every attention / MLP projection with
  one scale per output row (`reference.quantize_fp8(w, None)`); `fp8-block` with one scale
  per 128 x 128 block (`config.QUANTIZATION_BLOCKS`), the layout FP8 checkpoints ship, so
  their kernels can be measured on any float or dummy checkpoint.
- The memory the float projections held is returned to the device before the KV budget is
  read, so the KV pool gets it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from safetensors import safe_open

from metrale.config import QUANTIZATION_BLOCKS, EngineConfig
from metrale.errors import InvalidRequestError
from metrale.kernels import KernelOps
from metrale.kernels.reference import fp8_block_supported
from metrale.layers.fp8_linear import convert_projections
from metrale.models.loader import WeightMapping, checkpoint_files, target_name
from metrale.models.quantization import WeightQuant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Plan:
    """How a model's projections become FP8."""

    #: Scale layout: `(bo, bi)` blocks, or None (one scale per output row).
    block: tuple[int, int] | None
    #: True: quantize float weights at load (`--quantization fp8[-block]`); False: the
    #: checkpoint's.
    online: bool


def plan(config: EngineConfig, quant: WeightQuant | None, device: torch.device) -> Fp8Plan | None:
    """The FP8 plan for this load, None when every weight takes the model dtype."""
    if device.type != "cuda":
        if config.quantization is not None:
            raise InvalidRequestError(
                f"quantization '{config.quantization}' runs on CUDA only (the CPU has no FP8 "
                "kernels); leave it unset on the CPU (an FP8 checkpoint is then dequantized "
                "at load)",
                param="quantization",
            )
        return None
    if quant is not None:
        block = quant.block if quant.kind == "block" else None
        if not fp8_block_supported(block):
            logger.warning(
                "%s: the FP8 kernels take power-of-two blocks >= 16; dequantizing at load",
                quant.describe(),
            )
            return None
        return Fp8Plan(block, online=False)
    if config.quantization is not None:
        return Fp8Plan(QUANTIZATION_BLOCKS[config.quantization], online=True)
    return None


def quantized_targets(model_dir: str, mapping: WeightMapping, quant: WeightQuant) -> set[str]:
    """Parameter names (`...qkv_proj.weight`) that receive a quantized checkpoint weight (it
    has a scale tensor), read from the files' headers only."""
    suffix = "." + quant.scale_suffix
    targets: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(suffix):
                    target = target_name(name[: -len(quant.scale_suffix)] + "weight", mapping)
                    if target is not None:
                        targets.add(target)
    return targets


def convert(
    module: torch.nn.Module,
    ops: KernelOps,
    fp8: Fp8Plan,
    *,
    quantize: bool,
    only: set[str] | None = None,
) -> int:
    """The projections converted (`convert_projections`), the device cache emptied."""
    done = convert_projections(module, ops, fp8.block, quantize=quantize, only=only)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the float projections' memory goes back for the KV pool
    return done.converted


def describe(
    dtype: torch.dtype, fp8: Fp8Plan | None, converted: int, quant: WeightQuant | None
) -> str:
    """The model's weight dtype in words, for the start-up log and `LoadReport.weight_dtype`."""
    base = str(dtype).removeprefix("torch.")
    if fp8 is None or converted == 0:
        if quant is not None:
            return f"{base} (dequantized at load from {quant.describe()})"
        return base
    scales = "per-channel" if fp8.block is None else f"block {fp8.block[0]}x{fp8.block[1]}"
    how = "quantized at load" if fp8.online else "from the checkpoint"
    return f"fp8 e4m3 ({scales} scales, {how}; {converted} projections), {base} elsewhere"
