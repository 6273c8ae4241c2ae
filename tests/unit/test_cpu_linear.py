"""The CPU projections (`metrale.kernels.cpu_linear`) compute `F.linear`.

The few-row C GEMV (`cpu_gemv`): float32 within summation-order rounding of a float64 product,
with and without bias, every tail of the input width, 1-4 rows on 2- and 3-D layouts and
strided rows; a row's result is bit-identical whatever the other rows of the call and the
thread count. oneDNN (more rows, bfloat16): within rounding. Weights below `MIN_ELEMENTS`,
other dtypes and empty batches take `F.linear` itself (bit-identical). `kernels_for(cpu)`
selects and reports the paths, `METRALE_CPU_LINEAR` picks the mode (an unknown one is an
error), a kernel that cannot be built is logged and its batches counted as `gemv_unavailable`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels import cpu_gemv, cpu_linear, kernels_for, reference

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN in this torch")
_F32 = {"rtol": 1e-5, "atol": 1e-4}


@pytest.fixture(scope="module")
def gemv() -> cpu_gemv.CpuGemv:
    try:
        return cpu_gemv.load_gemv()
    except cpu_gemv.GemvUnavailable as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no C compiler here: {exc}")


def _f64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("n_in", [1, 15, 16, 17, 31, 32, 48, 63, 100, 512])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_gemv_equals_linear_for_every_width_and_row_count(
    gemv: cpu_gemv.CpuGemv, n_in: int, rows: int
) -> None:
    g = torch.Generator().manual_seed(n_in * 10 + rows)
    w = torch.randn(37, n_in, generator=g)
    b = torch.randn(37, generator=g)
    x = torch.randn(rows, n_in, generator=g)
    for bias in (None, b):
        got = gemv(x, w, bias)
        assert got.shape == (rows, 37) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), _f64(x, w, bias), rtol=1e-5, atol=1e-5)


def test_gemv_rows_independent_of_batch_and_threads(gemv: cpu_gemv.CpuGemv) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(300, 200, generator=g)
    x = torch.randn(4, 200, generator=g)
    together = gemv(x, w)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for i in range(4):
                assert torch.equal(gemv(x[i : i + 1], w)[0], together[i])
            assert torch.equal(gemv(x[1:3], w), together[1:3])
            assert torch.equal(gemv(x, w), together)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(1, 256), (3, 256), (2, 2, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_take_the_gemv_and_equal_f_linear(
    gemv: cpu_gemv.CpuGemv, shape: tuple[int, ...], bias: bool
) -> None:
    proj = cpu_linear.CpuLinear(gemv, onednn=True)
    g = torch.Generator().manual_seed(len(shape) + bias)
    w = torch.randn(640, 256, generator=g)  # above MIN_ELEMENTS
    b = torch.randn(640, generator=g) if bias else None
    x = torch.randn(*shape, generator=g)
    got = proj.linear(x, w, b)
    assert got.shape == (*shape[:-1], 640) and proj.counts["gemv"] == 1
    torch.testing.assert_close(got.double(), _f64(x, w, b), rtol=1e-5, atol=1e-5)
    strided = torch.randn(shape[0], 512, generator=g)[:, ::2]  # copied to a unit stride first
    torch.testing.assert_close(proj.linear(strided, w, b), F.linear(strided, w, b), **_F32)


@pytest.mark.parametrize("rows", [(5,), (7,), (2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_more_rows_and_bf16_take_onednn(
    gemv: cpu_gemv.CpuGemv, rows: tuple[int, ...], dtype: torch.dtype, bias: bool
) -> None:
    proj = cpu_linear.CpuLinear(gemv, onednn=True)
    g = torch.Generator().manual_seed(len(rows) + bias)
    w = torch.randn(640, 256, generator=g).to(dtype)
    b = torch.randn(640, generator=g).to(dtype) if bias else None
    x = torch.randn(*rows, 256, generator=g).to(dtype)
    got = proj.linear(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (*rows, 640) and got.dtype == dtype
    assert proj.counts["onednn"] == 1 and proj.counts["gemv"] == 0
    tol = _F32 if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(got.float(), want, **tol)


def test_small_weights_other_dtypes_and_empty_batches_run_f_linear(
    gemv: cpu_gemv.CpuGemv,
) -> None:
    proj = cpu_linear.CpuLinear(gemv, onednn=True)
    g = torch.Generator().manual_seed(3)
    small = torch.randn(64, 128, generator=g)
    x = torch.randn(3, 128, generator=g)
    assert torch.equal(proj.linear(x, small), F.linear(x, small))
    big = torch.randn(640, 256, generator=g, dtype=torch.float64)
    x64 = torch.randn(2, 256, generator=g, dtype=torch.float64)
    assert torch.equal(proj.linear(x64, big), F.linear(x64, big))
    empty = torch.empty(0, 256)
    assert proj.linear(empty, big.float()).shape == (0, 640)
    assert proj.counts == {"gemv": 0, "onednn": 0, "torch": 3, "gemv_unavailable": 0}
    forced = cpu_linear.CpuLinear(gemv, onednn=True, gemv_min_elements=0)
    torch.testing.assert_close(forced.linear(x, small), F.linear(x, small), **_F32)
    assert forced.counts["gemv"] == 1
    gate_up = torch.randn(4, 2 * 256, generator=g)
    torch.testing.assert_close(
        proj.silu_mul_linear(gate_up, big.float()),
        reference.silu_mul_linear(gate_up, big.float()), **_F32,
    )  # fmt: skip


def test_kernels_for_cpu_selects_by_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = kernels_for(torch.device("cpu"))
    # auto: the C kernel, then oneDNN on reordered copies within the memory budget
    assert ops.implementations["linear"] == "gemv+onednn-packed"
    assert ops.counters()["cpu_projection_gemv"] == 0
    x, w = torch.randn(1, 256), torch.randn(640, 256)
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), **_F32)
    assert ops.counters()["cpu_projection_gemv"] == 1
    monkeypatch.setenv("METRALE_CPU_LINEAR", "onednn")
    onednn = kernels_for(torch.device("cpu"))
    assert onednn.implementations["linear"] == "onednn"
    onednn.linear(x, w)
    assert onednn.counters()["cpu_projection_onednn"] == 1
    monkeypatch.setenv("METRALE_CPU_LINEAR", "torch")
    plain = kernels_for(torch.device("cpu"))
    assert plain.linear is reference.linear and plain.implementations["linear"] == "torch"
    assert plain.counters() == {}
    monkeypatch.setenv("METRALE_CPU_LINEAR", "fast")
    with pytest.raises(ValueError, match="METRALE_CPU_LINEAR='fast'"):
        kernels_for(torch.device("cpu"))


def test_a_kernel_that_cannot_be_built_is_logged_and_counted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_gemv.GemvUnavailable, match="no C compiler"):
        cpu_gemv.build(tmp_path)
    fake = tmp_path / "cc"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo fake && exit 0\necho boom >&2\nexit 3\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("METRALE_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(cpu_gemv.GemvUnavailable, match="failed \\(3\\): boom"):
        cpu_gemv.build()
    assert not list((tmp_path / "cache").iterdir())  # no half-written object left
    with caplog.at_level(logging.WARNING, logger="metrale.kernels.cpu_linear"):
        proj = cpu_linear.make("auto")
    assert proj is not None and proj.gemv is None
    assert "unavailable" in caplog.text and "boom" in caplog.text
    x, w = torch.randn(2, 256), torch.randn(640, 256)
    torch.testing.assert_close(proj.linear(x, w), F.linear(x, w), **_F32)
    assert proj.counts["gemv_unavailable"] == 1
    assert proj.counts["onednn"] + proj.counts.get("onednn_packed", 0) == 1


def test_build_is_cached_by_source_compiler_and_cpu(tmp_path: Path) -> None:
    try:
        first = cpu_gemv.build(tmp_path)
    except cpu_gemv.GemvUnavailable as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no C compiler here: {exc}")
    stamp = first.stat().st_mtime_ns
    assert cpu_gemv.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]


def test_packed_mode_reorders_each_weight_once_and_follows_changes(
    gemv: cpu_gemv.CpuGemv,
) -> None:
    proj = cpu_linear.CpuLinear(gemv, onednn=True, packed=True)
    assert proj.name == "gemv+onednn-packed"
    g = torch.Generator().manual_seed(11)
    w = torch.nn.Parameter(torch.randn(640, 256, generator=g), requires_grad=False)
    b = torch.randn(640, generator=g)
    x = torch.randn(9, 256, generator=g)
    torch.testing.assert_close(proj.linear(x, w, b), F.linear(x, w, b), **_F32)
    assert proj._packs is not None and len(proj._packs) == 1
    first = next(iter(proj._packs.values()))[2]
    proj.linear(x, w, b)
    assert next(iter(proj._packs.values()))[2] is first  # kept, not reordered again
    with torch.no_grad():
        w.mul_(2)  # changed in place: the next call reorders the new values
    torch.testing.assert_close(proj.linear(x, w, b), F.linear(x, w, b), **_F32)
    assert next(iter(proj._packs.values()))[2] is not first
    assert proj.counts["onednn_packed"] == 3 and proj.counts["onednn"] == 0
    torch.testing.assert_close(proj.linear(x[:2], w), F.linear(x[:2], w), **_F32)
    assert proj.counts["gemv"] == 1  # up to PACKED_GEMV_MAX_ROWS rows still take the C kernel
    proj.linear(x[:3], w)
    assert proj.counts["gemv"] == 1 and proj.counts["onednn_packed"] == 4
    del w
    assert not proj._packs  # the copy leaves with its weight


def test_an_unwritable_cache_falls_back_to_the_temporary_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("METRALE_KERNEL_CACHE", str(blocker / "cache"))  # cannot be made
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    try:
        built = cpu_gemv.build()
    except cpu_gemv.GemvUnavailable as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no C compiler here: {exc}")
    assert built.parent == tmp_path / "tmp" / f"metrale-cpu-kernels-{os.getuid()}"
    assert cpu_gemv.build() == built  # found there the next time


def test_copies_stay_within_their_budget(gemv: cpu_gemv.CpuGemv) -> None:
    """`auto` mode's budget: a weight whose copy would pass it stays on its dense layout (the C
    kernel up to MAX_ROWS rows beside it, counted, logged once); a copy that leaves with its
    weight gives its bytes back."""
    g = torch.Generator().manual_seed(12)
    first, second = (
        torch.nn.Parameter(torch.randn(640, 256, generator=g), requires_grad=False)
        for _ in range(2)
    )
    proj = cpu_linear.CpuLinear(gemv, onednn=True, packed=True, pack_budget=640 * 256 * 4)
    x = torch.randn(9, 256, generator=g)
    torch.testing.assert_close(proj.linear(x, first), F.linear(x, first), **_F32)
    assert proj.packed_bytes == 640 * 256 * 4 and proj.counts["onednn_packed"] == 1
    torch.testing.assert_close(proj.linear(x, second), F.linear(x, second), **_F32)
    assert proj.counts["onednn"] == 1 and proj.unpacked_over_budget == 1
    proj.linear(x[:3], second)  # dense beside it: 3 rows still take the C kernel
    proj.linear(x[:3], first)  # beside a copy: 3 rows take oneDNN on the copy
    assert proj.counts["gemv"] == 1 and proj.counts["onednn_packed"] == 2
    del first
    assert proj.packed_bytes == 0
    proj.linear(x, second)
    assert proj.counts["onednn_packed"] == 3 and proj.packed_bytes == 640 * 256 * 4
    assert cpu_linear.auto_pack_budget() <= cpu_linear.PACK_BUDGET_MAX_BYTES
