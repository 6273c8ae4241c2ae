"""Projections on the CPU through oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise`
over the dense weights as they are), instead of `F.linear`'s MKL GEMM.

Owner: kernels. `linear` and `silu_mul_linear` are the CPU entries of `KernelOps.linear` and
`KernelOps.silu_mul_linear` (`kernels_for` on a CPU device), unless the environment sets
`METRALE_CPU_LINEAR=torch` or this torch build lacks the op (then the torch reference, logged).

Why: on the AMD EPYC (Zen 5, AVX-512) machines this project runs on, oneDNN reads the weights
about twice as fast as MKL's float32 GEMV, at one row and at 16-256 rows alike
(`tools/bench_cpu_gemv.py`, bench/records/20261201T214331-cpu-gemv-*). Decode on the CPU is
bound by those weight reads.

Invariants:
- The same function as `reference.linear` in float32 arithmetic (no reduced precision): the
  results differ from MKL's only by float32 summation order (~1e-6 relative).
- Float32 and bfloat16 weights of at least `MIN_ELEMENTS` only; any other dtype, a smaller
  weight (where MKL's call is cheaper), an empty batch, or a non-contiguous weight runs
  `F.linear` (stated here and in the selection log, not a silent path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels import reference

_DTYPES = (torch.float32, torch.bfloat16)
#: Weights smaller than this (elements) run `F.linear`: oneDNN's ~15 us per call is more than
#: MKL spends on them (the crossover, measured by hand here, lies between 65K and 131K).
MIN_ELEMENTS = 131072


def available() -> bool:
    """Whether this torch build has oneDNN and the pointwise linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` by oneDNN (see the module docstring for when it is `F.linear`)."""
    if (
        x.dtype not in _DTYPES
        or x.numel() == 0
        or x.dim() < 2
        or weight.numel() < MIN_ELEMENTS
        or not weight.is_contiguous()
    ):
        return F.linear(x, weight, bias)
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.reshape(*lead, weight.shape[0])


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear(silu_and_mul(gate_up), weight, bias)`: a gated MLP's down projection."""
    return linear(reference.silu_and_mul(gate_up), weight, bias)
