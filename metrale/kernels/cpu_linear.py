"""Projections on the CPU: batches of a few rows (decode) by our C GEMV (`cpu_gemv`), larger ones
through oneDNN's inner product (`torch.ops.mkldnn._linear_pointwise` over the dense weights as
they are), instead of `F.linear`'s MKL GEMM.

Owner: kernels. `CpuLinear.linear` and `CpuLinear.silu_mul_linear` are the CPU entries of
`KernelOps.linear` and `KernelOps.silu_mul_linear` (`kernels_for` on a CPU device builds one
with `make`), and `CpuLinear.counters` their calls by path. The environment picks the mode,
`METRALE_CPU_LINEAR` (`MODES`): `auto` (default: the C kernel for float32 batches of a few rows
over weights of at least `MIN_ELEMENTS`, oneDNN for more rows of those weights, reading copies
it reordered into its own blocked layout, kept beside the dense weights up to a budget
(`auto_pack_budget`: 1 GiB, at most an eighth of the memory available at start); beside a
copy the C kernel takes up to `PACKED_GEMV_MAX_ROWS` rows, beside a dense weight up to
`cpu_gemv.MAX_ROWS`), `gemv` (the C kernel for every float32 few-row batch, whatever the
weight's size: the tests force it on tiny models so), `packed` (`auto` with no budget),
`onednn` (no C kernel, no copies) or `torch` (`F.linear`).

Why: on the AMD EPYC (Zen 5, AVX-512) machines this project runs on, MKL's float32 GEMV reads
weights at ~12 GB/s, oneDNN at ~15-20 GB/s, the C kernel at ~25-30 GB/s on one thread (what a
plain `tensor.sum()` reads), and a one-stream decode step of a model beyond the last-level cache
is bound by those reads; above a few rows oneDNN's blocked GEMM, which reuses each weight
across rows, is the faster (`tools/bench_cpu_gemv.py`, bench/records/*-cpu-gemv-*), and faster
again from its blocked layout (16 rows: 7.5 against 10.9 ms for the small model's step).

Invariants:
- The same function as `reference.linear` in float32 arithmetic (no reduced precision): the
  results differ from MKL's only by float32 summation order (~1e-6 relative).
- A weight below `MIN_ELEMENTS` (in `auto` mode), any dtype but float32/bfloat16, a dtype
  mismatch, an empty batch, a 1-D input or a non-contiguous weight runs `F.linear` (stated
  here, counted as `torch`). bfloat16 never takes the C kernel (oneDNN's bf16 path is fast).
- Copies (`auto`, `packed`): a weight is reordered on its first call above the few-row bound
  and the copy is kept while the weight lives and is unchanged (weakly keyed with its version
  counter; an inference-mode weight, which has no version counter, is not packed and runs the
  dense path); `packed_bytes` counts the copies kept, and a weight whose copy would take them
  past `pack_budget` stays dense (`unpacked_over_budget`, logged once). Reordering changes the
  layout oneDNN reads, not the arithmetic it does (float32 still).
- If the C kernel cannot be built (`cpu_gemv.GemvUnavailable`), `make` logs why once and the
  few-row batches it would have taken run oneDNN (or `F.linear`), each counted as
  `gemv_unavailable` besides its path: never silent.
"""

from __future__ import annotations

import logging
import os
import time
import weakref

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
MODES = ("auto", "gemv", "packed", "onednn", "torch")
#: The batch size oneDNN's weight reorder is told to expect in `packed` mode (a decode step of
#: many sequences; prefill chunks use the same packed weights).
PACK_BATCH = 16
#: In `packed` mode the C kernel takes batches of at most this many rows: from 3 rows oneDNN's
#: reordered weights are the faster (the small model's step, one thread: 2 rows 3.85 ms C
#: kernel against 4.23 packed, 3 rows 4.53 against 4.11, 4 rows 5.55 against 4.55; dense
#: oneDNN 7.4-8.2; bench/records/20261202T042114-cpu-gemv-* and …T042125…).
PACKED_GEMV_MAX_ROWS = 2
#: `auto` mode keeps reordered copies up to this many bytes in all, and at most
#: `PACK_BUDGET_SHARE` of the memory available at start (a weight beyond it runs on its dense
#: layout, with the C kernel up to `cpu_gemv.MAX_ROWS` rows): a small model gains the blocked
#: layout's speed for a second copy the machine can spare (issue 26: the small model served at
#: C=16, 665/569 -> 766/936 tok/s in two interleaved pairs of runs; +103 MB).
PACK_BUDGET_MAX_BYTES = 1 << 30
PACK_BUDGET_SHARE = 0.125


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
        packed: bool = False,
        pack_budget: int | None = None,
    ) -> None:
        self.gemv = gemv
        #: id(weight) -> (a weak reference to it, its version, oneDNN's reordered copy), when
        #: packing (None otherwise); an entry leaves with its weight.
        self._packs: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] | None = (
            {} if packed and onednn else None
        )
        #: The most bytes of reordered copies kept at once (None: no limit), and those kept.
        self.pack_budget = pack_budget
        self.packed_bytes = 0
        #: Calls that read a dense weight because its copy would pass the budget (logged once).
        self.unpacked_over_budget = 0
        self.onednn = onednn
        self.gemv_min_elements = gemv_min_elements
        #: Few-row batches count as `gemv_unavailable` when the kernel was wanted but is None.
        self._gemv_missing = gemv_wanted and gemv is None
        self.counts = {"gemv": 0, "onednn": 0, "torch": 0, "gemv_unavailable": 0}
        if self._packs is not None:
            self.counts["onednn_packed"] = 0

    @property
    def name(self) -> str:
        """The paths in words, for `KernelOps.implementations`: "gemv+onednn", "onednn", ..."""
        paths = [p for p, on in (("gemv", self.gemv), ("onednn", self.onednn)) if on]
        if self._packs is not None:
            paths[-1] += "-packed"
        return "+".join(paths) or "torch"

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
        rows = flat.shape[0]
        # Few rows take the C kernel: up to 2 beside a reordered copy, up to MAX_ROWS beside
        # the dense layout (measured crossovers: see PACKED_GEMV_MAX_ROWS, cpu_gemv.MAX_ROWS);
        # whether a weight has a copy is asked only where it decides (not for 1-2 rows).
        pack: bool | None = None
        if (
            rows <= cpu_gemv.MAX_ROWS
            and x.dtype == torch.float32
            and size >= self.gemv_min_elements
        ):
            if rows > PACKED_GEMV_MAX_ROWS:
                pack = self._pack_wanted(weight)
            if not pack:
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
        if pack is None:
            pack = self._pack_wanted(weight)
        if pack:
            counts["onednn_packed"] += 1
            weight = self._packed(weight)
        else:
            counts["onednn"] += 1
        out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
        return out.reshape(*lead, weight.shape[0])

    def _pack_wanted(self, weight: torch.Tensor) -> bool:
        """Whether oneDNN should read `weight` from a reordered copy (packing on, a weight
        with a version counter, within the budget). Callers have checked its size: only a
        weight of at least `MIN_ELEMENTS` reaches oneDNN, or the C kernel in packing modes."""
        return self._packs is not None and not weight.is_inference() and self._packable(weight)

    def _packable(self, weight: torch.Tensor) -> bool:
        """Whether `weight` has (or, within the budget, may take) a reordered copy."""
        packs = self._packs
        assert packs is not None
        kept = packs.get(id(weight))
        if (kept is not None and kept[0]() is weight) or self.pack_budget is None:
            return True
        if self.packed_bytes + _nbytes(weight) <= self.pack_budget:
            return True
        if not self.unpacked_over_budget:
            logger.info(
                "kernels: the reordered copies reached their budget (%.0f MiB): further "
                "weights run on their dense layout, counted in unpacked_over_budget",
                self.pack_budget / 2**20,
            )  # fmt: skip
        self.unpacked_over_budget += 1
        return False

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        packs = self._packs
        assert packs is not None
        key = id(weight)
        kept = packs.get(key)
        if kept is not None and kept[0]() is weight and kept[1] == weight._version:
            return kept[2]
        if kept is not None:
            self.packed_bytes -= _nbytes(kept[2])
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH)
        self.packed_bytes += _nbytes(reordered)

        def forget(ref: weakref.ref[torch.Tensor], key: int = key) -> None:
            entry = packs.get(key)
            if entry is not None and entry[0] is ref:
                del packs[key]
                self.packed_bytes -= _nbytes(entry[2])

        packs[key] = (weakref.ref(weight, forget), weight._version, reordered)
        return reordered

    def silu_mul_linear(
        self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`linear(silu_and_mul(gate_up), weight, bias)`: a gated MLP's down projection."""
        return self.linear(reference.silu_and_mul(gate_up), weight, bias)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def auto_pack_budget() -> int:
    """`auto` mode's budget for reordered copies: `PACK_BUDGET_MAX_BYTES`, at most
    `PACK_BUDGET_SHARE` of the memory available now (`/proc/meminfo`; 0 where unreadable)."""
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        available_bytes = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0
    return min(PACK_BUDGET_MAX_BYTES, int(available_bytes * PACK_BUDGET_SHARE))


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
    budget = auto_pack_budget() if mode == "auto" else None
    packing = onednn and (mode == "packed" or bool(budget))
    rows = PACKED_GEMV_MAX_ROWS if packing else cpu_gemv.MAX_ROWS
    if mode in ("auto", "gemv", "packed"):
        start = time.perf_counter()
        try:
            gemv = cpu_gemv.load_gemv()
        except cpu_gemv.GemvUnavailable as exc:
            logger.warning(
                "kernels: the CPU few-row projection kernel is unavailable (%s); batches of "
                "<= %d rows run %s instead (slower), counted as "
                "metrale_cpu_projections{path=\"gemv_unavailable\"}",
                exc, rows, "oneDNN" if onednn else "F.linear",
            )  # fmt: skip
        else:
            logger.info(
                "kernels: CPU projections of <= %d float32 rows by the C GEMV (%s, %.2f s)%s; "
                "more rows by %s", rows, gemv.path.name,
                time.perf_counter() - start,
                "" if mode == "gemv" else f" for weights of >= {MIN_ELEMENTS} elements",
                "oneDNN" if onednn else "F.linear",
            )  # fmt: skip
    elif onednn:
        logger.info("kernels: CPU projections by oneDNN (METRALE_CPU_LINEAR=onednn)")
    if packing:
        logger.info(
            "kernels: oneDNN reads reordered copies of the weights above %d rows (a second "
            "copy of each weight of >= %d elements, %s; METRALE_CPU_LINEAR=onednn or gemv "
            "keep none)", rows, MIN_ELEMENTS,
            "no limit: METRALE_CPU_LINEAR=packed" if budget is None
            else f"up to {budget / 2**20:.0f} MiB of copies",
        )  # fmt: skip
    return CpuLinear(
        gemv, onednn, gemv_min_elements=0 if mode == "gemv" else MIN_ELEMENTS,
        gemv_wanted=mode in ("auto", "gemv", "packed"), packed=packing, pack_budget=budget,
    )  # fmt: skip
