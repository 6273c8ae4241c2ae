"""GPU test tier: tests marked `gpu` run on a CUDA machine and are skipped elsewhere.

With `METRALE_TRITON_INTERPRET=1` the kernel tests run without a GPU instead: Triton's CPU
interpreter (`TRITON_INTERPRET=1`, set here before anything imports triton) executes the
kernels on CPU tensors. Only tests that can run interpreted opt in (marker `interpretable`);
CUDA-only tests (graph capture, timing) still skip. Nothing here imports triton unless the
interpreter was asked for.

Owner: tests (gpu). This file owns the tier's skip rule: without CUDA and without the
interpreter a test module here is skipped whole before it is imported (so its triton imports
never run), with one reason; a module needs no preamble of its own.

Invariants:
- Without CUDA and without `METRALE_TRITON_INTERPRET=1`, every `test_*.py` here is one skipped
  module, as a module-level `pytest.skip` would make it.
- Under the interpreter, only `interpretable` tests run; the rest skip as CUDA only.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

_HERE = Path(__file__).parent


def _patch_interpreter() -> None:
    """Three fixes to Triton 3.6's CPU interpreter (compiled kernels are unaffected):

    - scalar kernel arguments are 1-element arrays that it converts with `int(array)`, which
      NumPy >= 2.4 rejects (loops with a run-time bound fail): convert through `[0]`;
    - it casts float32 to bfloat16 by truncation, where the GPU rounds to nearest even: that
      biases every bf16 output by up to one ulp, so round to nearest even as the GPU does;
    - its round-to-nearest-even cast to float8 E4M3 drops the carry when the mantissa rounds
      up past 1.75 (125.0 becomes 64.0): cast through torch (round to nearest even, as the
      GPU's `cvt.rn` does; callers saturate to +-448 first, as the float8 KV writers do).
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_metrale_patched", False):
        return

    def patched(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(
            tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        )

    patched._metrale_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched

    builder = interpreter.InterpreterBuilder
    original_cast = builder.cast_impl
    original_fp_to_fp = builder.create_fp_to_fp

    def to_e4m3(src):  # type: ignore[no-untyped-def]
        wide = np.asarray(src.data).astype(np.float32)
        out = torch.from_numpy(np.ascontiguousarray(wide)).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(out.view(torch.uint8).numpy(), tl.float8e4nv)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # type: ignore[no-untyped-def]
        # float32 / float16 sources (numpy holds them natively; bf16 is raw uint16 there).
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16):
            return to_e4m3(src)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder.create_fp_to_fp = create_fp_to_fp

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16):
            return to_e4m3(src)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            wide = bits.astype(np.uint64)
            rounded = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(np.asarray(src.data, dtype=np.float32))
            rounded = np.where(nan, np.uint16(0x7FC0), rounded).astype(np.uint16)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl


if INTERPRET and importlib.util.find_spec("triton") is not None:
    _patch_interpreter()


#: Whether this tier can run at all: a CUDA device, or Triton's interpreter asked for.
RUNNABLE = torch.cuda.is_available() or INTERPRET
SKIP_REASON = "needs CUDA or METRALE_TRITON_INTERPRET=1"


class _SkippedModule(pytest.Module):
    """A test module of this tier on a machine that cannot run it: skipped, never imported."""

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        pytest.skip(SKIP_REASON, allow_module_level=True)


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    if RUNNABLE or _HERE not in module_path.parents:
        return None
    return _SkippedModule.from_parent(parent, path=module_path)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "interpretable: a gpu test that can also run under METRALE_TRITON_INTERPRET=1"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = torch.cuda.is_available()
    triton_installed = importlib.util.find_spec("triton") is not None
    for item in items:
        if _HERE not in item.path.parents or "gpu" not in item.keywords:
            continue
        if INTERPRET:
            if not triton_installed:
                item.add_marker(pytest.mark.skip(reason="METRALE_TRITON_INTERPRET needs triton"))
            elif "interpretable" not in item.keywords:
                item.add_marker(pytest.mark.skip(reason="CUDA only (not under the interpreter)"))
        elif not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
