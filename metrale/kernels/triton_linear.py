"""Projections on CUDA: the GEMV kernel for few-row (decode) batches, cuBLAS for the rest.

Owner: kernels. `linear` and `silu_mul_linear` are the CUDA entries of `KernelOps.linear` and
`KernelOps.silu_mul_linear`; they compute `reference.linear` / `reference.silu_mul_linear`.

Invariants:
- A call with at most `GEMV_MAX_ROWS` rows (2-D x, x and W of one dtype) goes to
  `triton_gemv`; everything else to `torch.nn.functional.linear` (cuBLAS). The choice depends
  only on shapes and dtypes, so a captured decode graph always holds the same kernels.
- `pdl=True` launches the GEMV as a programmatic dependent (see `triton_attention_common`);
  cuBLAS calls ignore it.
- At batch 1 a decode step is bound by reading the weights; cuBLAS reached about 87% of the
  H200's copy bandwidth there, which is why few rows take the GEMV (see
  `tools/bench_gemv.py` and the `gemv` record under bench/records/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels.triton_gemv import MAX_M, gemv, gemv_silu_mul
from metrale.kernels.triton_norm import silu_and_mul

#: Most rows sent to the GEMV kernel (measured on the H200: at 4 rows cuBLAS was faster for
#: qkv and gate_up, 0.80x and 0.74x).
GEMV_MAX_ROWS = min(2, MAX_M)


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS and x.dtype == weight.dtype


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    if _gemv_fits(x, weight):
        return gemv(x, weight, bias, pdl=pdl)
    return F.linear(x, weight, bias)


def silu_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
) -> torch.Tensor:
    if _gemv_fits(gate_up, weight):
        return gemv_silu_mul(gate_up, weight, bias, pdl=pdl)
    return F.linear(silu_and_mul(gate_up), weight, bias)
