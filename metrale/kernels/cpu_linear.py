"""Projections on the CPU: batches of a few rows (decode) by our C GEMV (`cpu_gemv`), larger ones
through oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise` over the dense weights as
they are), instead of `F.linear`'s MKL GEMM.

Owner: kernels. `CpuLinear.linear` and `CpuLinear.silu_mul_linear` are the CPU entries of
`KernelOps.linear` and `KernelOps.silu_mul_linear` (`kernels_for` on a CPU device builds one
with `make`), and `CpuLinear.counters` their calls by path. The environment picks the mode,
`METRALE_CPU_LINEAR` (`MODES`): `auto` (default: the C kernel for float32 batches of at most
`cpu_gemv.MAX_ROWS` rows over weights of at least `MIN_ELEMENTS`, oneDNN for the rest of
those weights), `gemv` (the C kernel for every float32 few-row batch, whatever the weight's
size: the tests force it on tiny models so), `onednn` (no C kernel) or `torch` (`F.linear`).

Why: on the AMD EPYC (Zen 5, AVX-512) machines this project runs on, MKL's float32 GEMV reads
weights at ~12 GB/s, oneDNN at ~15-20 GB/s, the C kernel at ~25-30 GB/s on one thread (what a
plain `tensor.sum()` reads), and a one-stream decode step of a model beyond the last-level cache
is bound by those reads; above a few rows oneDNN's blocked GEMM, which reuses each weight
across rows, is the faster (`tools/bench_cpu_gemv.py`, bench/records/*-cpu-gemv-*).

Invariants:
- The same function as `reference.linear` in float32 arithmetic (no reduced precision): the
  results differ from MKL's only by float32 summation order (~1e-6 relative).
- A weight below `MIN_ELEMENTS` (in `auto` mode), any dtype but float32/bfloat16, a dtype
  mismatch, an empty batch, a 1-D input or a non-contiguous weight runs `F.linear` (stated
  here, counted as `torch`). bfloat16 never takes the C kernel (oneDNN's bf16 path is fast).
- If the C kernel cannot be built (`cpu_gemv.GemvUnavailable`), `make` logs why once and the
  few-row batches it would have taken run oneDNN (or `F.linear`), each counted as
  `gemv_unavailable` besides its path: never silent.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F

from metrale.kernels import cpu_gemv, reference

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)
#: Weights smaller than this (elements) run `F.linear` in `auto` mode: oneDNN's ~15 us per
#: call, and the C kernel's ~3 us of call overhead (ctypes, the output), are more than MKL
#: spends on them (oneDNN's crossover, measured by hand here, lies between 65K and 131K).
MIN_ELEMENTS = 131072
#: `METRALE_CPU_LINEAR` values.
MODES = ("auto", "gemv", "onednn", "torch")


def available() -> bool:
    """Whether this torch build has oneDNN and the pointwise linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def mode_from_env() -> str:
    """`METRALE_CPU_LINEAR` (default `auto`); an unknown value is an error naming it."""
    mode = os.environ.get("METRALE_CPU_LINEAR", "auto")
    if mode not in MODES:
        raise ValueError(f"METRALE_CPU_LINEAR={mode!r}: expected one of {', '.join(MODES)}")
    return mode


class CpuLinear:
    """The CPU projections of one `KernelOps` (see the module docstring)."""

    def __init__(
        self,
        gemv: cpu_gemv.CpuGemv | None,
        onednn: bool,
        gemv_min_elements: int = MIN_ELEMENTS,
        gemv_wanted: bool = True,
    ) -> None:
        self.gemv = gemv
        self.onednn = onednn
        self.gemv_min_elements = gemv_min_elements
        #: Few-row batches count as `gemv_unavailable` when the kernel was wanted but is None.
        self._gemv_missing = gemv_wanted and gemv is None
        self.counts = {"gemv": 0, "onednn": 0, "torch": 0, "gemv_unavailable": 0}

    def counters(self) -> dict[str, int]:
        """Calls by path, as `cpu_projection_<path>` (the model's forward counters)."""
        return {f"cpu_projection_{k}": v for k, v in self.counts.items()}

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x @ weight.T + bias` (see the module docstring for which path runs it)."""
        counts = self.counts
        if (
            x.dtype not in _DTYPES
            or x.numel() == 0
            or x.dim() < 2
            or weight.dtype != x.dtype
            or (bias is not None and bias.dtype != x.dtype)
            or not weight.is_contiguous()
        ):
            counts["torch"] += 1
            return F.linear(x, weight, bias)
        size = weight.numel()
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if (
            flat.shape[0] <= cpu_gemv.MAX_ROWS
            and x.dtype == torch.float32
            and size >= self.gemv_min_elements
        ):
            if self.gemv is not None and (bias is None or bias.is_contiguous()):
                if flat.stride(-1) != 1:
                    flat = flat.contiguous()
                counts["gemv"] += 1
                return self.gemv(flat, weight, bias).reshape(*lead, weight.shape[0])
            if self._gemv_missing:
                counts["gemv_unavailable"] += 1
        if not self.onednn or size < MIN_ELEMENTS:
            counts["torch"] += 1
            return F.linear(x, weight, bias)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        counts["onednn"] += 1
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
        return out.reshape(*lead, weight.shape[0])

    def silu_mul_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`linear(silu_and_mul(gate_up), weight, bias)`: a gated MLP's down projection."""
        return self.linear(reference.silu_and_mul(gate_up), weight, bias)


def make(mode: str) -> CpuLinear | None:
    """The `CpuLinear` for a mode (`MODES`), or None for `torch` (the references); logs what
    it chose, and why the C kernel is missing when it is."""
    if mode == "torch":
        logger.info("kernels: CPU projections by F.linear (METRALE_CPU_LINEAR=torch)")
        return None
    onednn = available()
    if not onednn:
        logger.warning("kernels: oneDNN's linear is missing from this torch; F.linear (slower)")
    gemv = None
    if mode in ("auto", "gemv"):
        start = time.perf_counter()
        try:
            gemv = cpu_gemv.load_gemv()
        except cpu_gemv.GemvUnavailable as exc:
            logger.warning(
                "kernels: the CPU few-row projection kernel is unavailable (%s); batches of "
                "<= %d rows run %s instead (slower), counted as "
                "metrale_cpu_projections{path=\"gemv_unavailable\"}",
                exc, cpu_gemv.MAX_ROWS, "oneDNN" if onednn else "F.linear",
            )  # fmt: skip
        else:
            logger.info(
                "kernels: CPU projections of <= %d float32 rows by the C GEMV (%s, %.2f s)%s; "
                "more rows by %s", cpu_gemv.MAX_ROWS, gemv.path.name,
                time.perf_counter() - start,
                "" if mode == "gemv" else f" for weights of >= {MIN_ELEMENTS} elements",
                "oneDNN" if onednn else "F.linear",
            )  # fmt: skip
    elif onednn:
        logger.info("kernels: CPU projections by oneDNN (METRALE_CPU_LINEAR=onednn)")
    return CpuLinear(
        gemv, onednn, gemv_min_elements=0 if mode == "gemv" else MIN_ELEMENTS,
        gemv_wanted=mode in ("auto", "gemv"),
    )  # fmt: skip
