"""Few-row float32 projections on the CPU by a C kernel of our own (`csrc/cpu_gemv.c`), built
at start-up with the machine's C compiler and called through ctypes.

Owner: kernels. `load_gemv` builds (or finds in its cache) and loads the kernel; `CpuGemv` calls
it. `cpu_linear.CpuLinear` decides which projections take it (float32, at most `MAX_ROWS` rows).
The same shared object holds the fused decode step (`cpu_decode.py`) and the decode
attention (`cpu_ops.py`); `kernel_function` loads every entry point of it.

Why (issue 26): a one-stream decode step of a model whose weights exceed the last-level cache
reads every weight once from memory, so its projections are bound by how fast they read. MKL's
GEMV and oneDNN's inner product read at 10-17 GB/s on this project's AMD EPYC (Zen 5) machines;
this kernel reads each weight row once, front to back, and reaches what a plain `tensor.sum()`
reads (25-30 GB/s on one thread, 31-37 on two; `tools/bench_cpu_gemv.py`). Above a few rows
oneDNN's blocked GEMM, which reuses each weight across rows, is faster.

Invariants:
- The kernel's arithmetic is fixed (see the C file's header): float32 products and sums with
  fused multiply-adds, 32 partial sums per output combined in one fixed order, so a row's
  result depends neither on the other rows of the call nor on the thread count. It differs
  from MKL's by float32 summation order only (~1e-6 relative).
- The shared object is cached under `cache_dir()` (or, when that cannot be written, a
  per-user directory under the system's temporary directory) by a digest of the source, the
  compiler's version, the flags and the CPU's flags (`-march=native` code only runs where it
  was built); it is written to a temporary name and renamed, so concurrent processes never
  load half a file.
- A failed build raises `GemvUnavailable` naming the command and its error; the caller logs it
  and counts the projections that run oneDNN instead (never silent).
- Threads: the kernel runs in torch's own OpenMP runtime (the one `libgomp.so.1` torch loaded)
  with `torch.get_num_threads()` threads, split by contiguous output ranges.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

#: Rows (tokens) up to which a float32 projection takes the kernel; more take oneDNN.
MAX_ROWS = 4
SOURCE = Path(__file__).parent / "csrc" / "cpu_gemv.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
#: Libraries linked after the source (the fused decode step's expf / sqrtf).
LIBS = ("-lm",)
_SYMBOL = "metrale_gemv_f32"


class GemvUnavailable(RuntimeError):
    """The C kernel could not be built or loaded (no compiler, a compile error, ...)."""


def cache_dir() -> Path:
    """Where built kernels are kept: `METRALE_KERNEL_CACHE`, else
    `$XDG_CACHE_HOME/metrale/cpu_kernels` (default `~/.cache/metrale/cpu_kernels`)."""
    explicit = os.environ.get("METRALE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "metrale" / "cpu_kernels"


def _temporary_cache() -> Path:
    return Path(tempfile.gettempdir()) / f"metrale-cpu-kernels-{os.getuid()}"


def cpu_flags() -> str:
    """The CPU's `flags` line of /proc/cpuinfo (the machine name off Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.strip()
    except OSError:  # pragma: no cover - not Linux
        pass
    return os.uname().machine


def _compiler() -> str:
    cc = os.environ.get("CC", "cc")
    found = shutil.which(cc)
    if found is None:
        raise GemvUnavailable(f"no C compiler: {cc!r} is not on PATH (set CC)")
    return found


def build(directory: Path | None = None) -> Path:
    """The kernel's shared object, built now unless the cache has it; raises
    `GemvUnavailable` with the compiler's message when it cannot be built."""
    cc = _compiler()
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise GemvUnavailable(f"{cc} --version failed: {exc}") from exc
    source = SOURCE.read_bytes()
    digest = hashlib.sha256()
    flags = " ".join(FLAGS + LIBS).encode()
    for part in (source, version.encode(), flags, cpu_flags().encode()):
        digest.update(part)
        digest.update(b"\0")
    name = f"cpu_gemv-{digest.hexdigest()[:20]}.so"
    # An unwritable default cache (a read-only home) falls back to the temporary directory.
    places = [directory] if directory else [cache_dir(), _temporary_cache()]
    for place in places:
        if (place / name).exists():
            return place / name
    for place in places:
        try:
            place.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".cpu_gemv-", suffix=".so", dir=place)
        except OSError as exc:
            error = exc
            continue
        os.close(fd)
        target = place / name
        break
    else:
        raise GemvUnavailable(f"cannot write the kernel cache {places[-1]}: {error}")
    cmd = [cc, *FLAGS, str(SOURCE), *LIBS, "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise GemvUnavailable(
                f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GemvUnavailable(f"`{' '.join(cmd)}` failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuGemv:
    """The loaded kernel: `CpuGemv(path)(x, weight, bias)` is `F.linear(x, weight, bias)` for
    a float32 `x` of shape `[rows, in]` (unit stride along `in`) and a contiguous float32
    `weight` `[out, in]` (and `bias` `[out]`); the caller checks dtypes and layout."""

    def __init__(self, path: Path) -> None:
        ptr, long = ctypes.c_void_p, ctypes.c_long
        self._fn = kernel_function(
            path, _SYMBOL, [ptr, long, ptr, ptr, ptr, long, long, long, ctypes.c_int]
        )
        self.path = path

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        rows, n_in = x.shape
        n_out = weight.shape[0]
        y = torch.empty((rows, n_out), dtype=torch.float32)
        self._fn(
            x.data_ptr(), x.stride(0), weight.data_ptr(),
            None if bias is None else bias.data_ptr(), y.data_ptr(),
            rows, n_in, n_out, torch.get_num_threads(),
        )  # fmt: skip
        return y


def kernel_function(
    path: Path | None, symbol: str, argtypes: list[Any], restype: Any = None
) -> Any:
    """`symbol` of the kernels' shared object (`path`; None: `build()`), with its ctypes
    signature; raises `GemvUnavailable` when it cannot be built, loaded or found. The one
    loader of every C entry point (the GEMV, the fused decode step, the decode attention)."""
    path = build() if path is None else path
    try:
        fn = getattr(ctypes.CDLL(str(path)), symbol)
    except (OSError, AttributeError) as exc:
        raise GemvUnavailable(f"cannot load {symbol} from {path}: {exc}") from exc
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def load_gemv(directory: Path | None = None) -> CpuGemv:
    """Build (or find) and load the kernel; raises `GemvUnavailable`."""
    return CpuGemv(build(directory))
