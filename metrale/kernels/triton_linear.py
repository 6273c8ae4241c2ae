"""Projections on CUDA: the GEMV kernel for few-row (decode) batches, cuBLAS for the rest.

Owner: kernels. `linear` and `silu_mul_linear` are the CUDA entries of `KernelOps.linear` and
`KernelOps.silu_mul_linear`; they compute `reference.linear` / `reference.silu_mul_linear`.

Invariants:
- A call with at most `GEMV_MAX_ROWS` rows (2-D x, x and W of one dtype) goes to
  `triton_gemv`; everything else to `torch.nn.functional.linear` (cuBLAS). The choice depends
  only on shapes and dtypes, so a captured decode graph always holds the same kernels.
- `pdl=True` launches the GEMV as a programmatic dependent (see `triton_attention_common`);
  cuBLAS calls ignore it.
- `lora_linear` (`KernelOps.lora_linear`) is a projection plus one LoRA group's deltas
  (`lora_reference.lora_linear`). Up to `EPILOGUE_MAX_ROWS` rows (the GEMV's, by default)
  with `triton_lora.FEW_ROWS_FORM` "epilogue", it is two launches: the LoRA shrink
  (`triton_lora_epilogue.lora_shrink`), then the GEMV adding each row's delta as it stores
  (`gemv(..., lora=)`; `gemv_silu_mul` for the down projection, `act=True`); else the
  projection, then `triton_lora.lora_gather_add` (form "auto").
- At batch 1 a decode step is bound by reading the weights; cuBLAS reached about 87% of the
  H200's copy bandwidth there, which is why few rows take the GEMV (see
  `tools/bench_gemv.py` and the `gemv` record under bench/records/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.kernels import triton_lora
from metrale.kernels.triton_gemv import MAX_M, gemv, gemv_silu_mul
from metrale.kernels.triton_lora_epilogue import lora_shrink
from metrale.kernels.triton_norm import silu_and_mul

#: Most rows sent to the GEMV kernel (measured on the H200: at 4 rows cuBLAS was faster for
#: qkv and gate_up, 0.80x and 0.74x).
GEMV_MAX_ROWS = min(2, MAX_M)
#: Most rows `lora_linear` runs in the epilogue form (the GEMV with the expand in its stores)
#: when `FEW_ROWS_FORM` is "epilogue"; more rows take cuBLAS and the gather op. The GEMV's
#: rows by default; `tools/bench_lora_kernels.py --group-rows` times the epilogue form
#: against cuBLAS + the split pair beyond them.
EPILOGUE_MAX_ROWS = GEMV_MAX_ROWS


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


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b_t: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
    *,
    act: bool = False,
    pdl: bool = False,
    form: str = "auto",
    sync: torch.Tensor | None = None,
) -> torch.Tensor:
    """`lora_reference.lora_linear`: `linear(x, weight, bias)` (with `act`,
    `silu_mul_linear(x, ...)`), then the deltas of one LoRA group whose targets cover every
    output column (`a`, `b_t`, `token_slots`, `scales`, `widths` as `lora_gather_add`).
    `form`: "epilogue" (the shrink, then the GEMV with the delta in its stores; at most
    `MAX_M` rows), a `lora_gather_add` form ("split", "fused", "sync": the projection, then
    that op), or "auto": "epilogue" up to `EPILOGUE_MAX_ROWS` rows when `FEW_ROWS_FORM` is
    "epilogue", else the projection and `lora_gather_add`'s "auto". `sync`: that op's
    counters."""
    if form == "auto":
        rows = x.shape[0] if x.dim() == 2 else 0
        fits = 0 < rows <= EPILOGUE_MAX_ROWS and x.dtype == weight.dtype == b_t.dtype
        form = "epilogue" if fits and triton_lora.FEW_ROWS_FORM == "epilogue" else "auto"
    if form == "epilogue":
        if x.dtype != b_t.dtype:
            raise TypeError(f"lora_linear: x {x.dtype} and the LoRA stacks {b_t.dtype} differ")
        lora = lora_shrink(x, a, b_t, token_slots, scales, widths, act=act, pdl=pdl)
        if act:
            return gemv_silu_mul(x, weight, bias, pdl=pdl, lora=lora)
        return gemv(x, weight, bias, pdl=pdl, lora=lora)
    inp = silu_and_mul(x) if act else x
    y = linear(inp, weight, bias, pdl=pdl)
    counters = {} if sync is None else {"sync": sync}
    triton_lora.lora_gather_add(
        y, inp, a, b_t, token_slots, scales, widths, pdl=pdl, form=form, **counters
    )
    return y
