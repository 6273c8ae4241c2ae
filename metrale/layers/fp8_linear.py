"""FP8 (E4M3) projections: `Fp8Linear`, a `Linear` whose weight stays in FP8 with its float32
scales and computes through `KernelOps.linear_fp8`; and `convert_projections`, which swaps
the fused attention and MLP projections of a built model for them.

Owner: layers.

Invariants:
- An `Fp8Linear` holds `weight` (`float8_e4m3fn [out, in]`), `weight_scale` (float32; `[cdiv
  (out, bo), cdiv(in, bi)]` for a `block`, `[out]` per output row when `block` is None) and
  the bias in the model dtype; its output equals `reference.linear_fp8` on them.
- `convert_projections` converts only projections the layers route through `project` /
  `project_silu_mul` (`AttentionProjections.qkv_proj` / `o_proj`, `GatedMLP.gate_up_proj` /
  `down_proj`); everything else (embeddings, lm_head, norms, recurrent mixers, MoE experts)
  stays in the model dtype. A fused projection whose checkpoint parts do not start on a
  row-block boundary cannot hold their block scales: it stays in the model dtype (the loader
  dequantizes it), and the count is logged.
- With `quantize=True` the existing weights are quantized in place of the module
  (`reference.quantize_fp8`); with False the new weights are left for the loader to fill.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from metrale.kernels import KernelOps, reference

logger = logging.getLogger(__name__)


class Fp8Linear(nn.Module):
    """`y = x @ (fp8 weight * scale).T + bias`, through `ops.linear_fp8`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        block: tuple[int, int] | None,
        ops: KernelOps,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.block = block
        self.ops = ops
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
            requires_grad=False,
        )
        shape = (
            (out_features,)
            if block is None
            else (-(-out_features // block[0]), -(-in_features // block[1]))
        )
        self.weight_scale = nn.Parameter(
            torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_fp8(x, self.weight, self.weight_scale, self.bias, self.block)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`forward(silu_and_mul(gate_up))`, fused where the kernels fuse it."""
        return self.ops.silu_mul_linear_fp8(
            gate_up, self.weight, self.weight_scale, self.bias, self.block
        )

    def extra_repr(self) -> str:
        scales = "per-row" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3, {scales}"


def project(ops: KernelOps, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A projection through the kernel ops: `linear_fp8` for an `Fp8Linear`, else `linear`."""
    if isinstance(proj, Fp8Linear):
        return proj(x)
    return ops.linear(x, proj.weight, proj.bias)


def project_silu_mul(ops: KernelOps, proj: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """`project(ops, proj, silu_and_mul(gate_up))`, fused."""
    if isinstance(proj, Fp8Linear):
        return proj.silu_mul(gate_up)
    return ops.silu_mul_linear(gate_up, proj.weight, proj.bias)


@dataclass
class Conversion:
    """What `convert_projections` did."""

    converted: int = 0
    #: Fused projections left in the model dtype (their parts cut a row block).
    kept: int = 0


def _fits(parts: list[int], block: tuple[int, int] | None) -> bool:
    """Whether fused parts of these row counts each start on a row-block boundary."""
    if block is None:
        return True
    return all(p % block[0] == 0 for p in parts[:-1])


def convert_projections(
    module: nn.Module,
    ops: KernelOps,
    block: tuple[int, int] | None,
    *,
    quantize: bool,
    only: set[str] | None = None,
) -> Conversion:
    """Swap every attention / gated-MLP projection of `module` for an `Fp8Linear` (see the
    invariants); `quantize`: fill it from the current weights, else leave it to the loader;
    `only`: just the projections whose weight parameter is named there."""
    from metrale.layers.common import AttentionProjections, GatedMLP

    result = Conversion()
    for prefix, sub in list(module.named_modules()):
        if isinstance(sub, AttentionProjections):
            q_rows = sub.qkv_proj.out_features - 2 * sub.kv_size
            named = {"qkv_proj": [q_rows, sub.kv_size, sub.kv_size], "o_proj": [sub.q_size]}
        elif isinstance(sub, GatedMLP):
            half = sub.gate_up_proj.out_features // 2
            named = {"gate_up_proj": [half, half], "down_proj": [sub.down_proj.out_features]}
        else:
            continue
        for name, parts in named.items():
            old = getattr(sub, name)
            weight_name = f"{prefix}.{name}.weight" if prefix else f"{name}.weight"
            if not isinstance(old, nn.Linear) or (only is not None and weight_name not in only):
                continue
            if not quantize and not _fits(parts, block):
                result.kept += 1
                continue
            new = Fp8Linear(
                old.in_features, old.out_features, old.bias, block, ops, old.weight.device
            )
            if quantize:
                with torch.no_grad():
                    q, s = reference.quantize_fp8(old.weight, block)
                    new.weight.copy_(q)
                    new.weight_scale.copy_(s)
            setattr(sub, name, new)
            result.converted += 1
    if result.kept:
        logger.warning(
            "fp8: %d fused projections stay in the model dtype: their parts do not start on "
            "%s-row block boundaries, so their block scales cannot be concatenated",
            result.kept, block[0] if block else "?",
        )  # fmt: skip
    return result
