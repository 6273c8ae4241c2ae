"""The CPU projections through oneDNN (`metrale.kernels.cpu_linear`) compute `F.linear`: float32
within summation-order rounding, bfloat16 within its rounding, with bias, on 1-, 2- and 3-D
row layouts; weights below `MIN_ELEMENTS`, other dtypes and empty batches take `F.linear`
itself (bit-identical); `kernels_for(cpu)` selects it and reports it, and
`METRALE_CPU_LINEAR=torch` turns it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metrale.kernels import cpu_linear, kernels_for, reference

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN in this torch")


@pytest.mark.parametrize("rows", [(1,), (7,), (2, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_equals_f_linear(
    rows: tuple[int, ...], dtype: torch.dtype, bias: bool
) -> None:
    g = torch.Generator().manual_seed(len(rows) + bias)
    w = torch.randn(640, 256, generator=g).to(dtype)  # above MIN_ELEMENTS
    b = torch.randn(640, generator=g).to(dtype) if bias else None
    x = torch.randn(*rows, 256, generator=g).to(dtype)
    got = cpu_linear.linear(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (*rows, 640) and got.dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(got.float(), want, **tol)


def test_small_weights_other_dtypes_and_empty_batches_run_f_linear() -> None:
    g = torch.Generator().manual_seed(3)
    small = torch.randn(64, 128, generator=g)
    x = torch.randn(3, 128, generator=g)
    assert torch.equal(cpu_linear.linear(x, small), F.linear(x, small))
    big = torch.randn(640, 256, generator=g, dtype=torch.float64)
    x64 = torch.randn(2, 256, generator=g, dtype=torch.float64)
    assert torch.equal(cpu_linear.linear(x64, big), F.linear(x64, big))
    empty = torch.empty(0, 256)
    assert cpu_linear.linear(empty, big.float()).shape == (0, 640)
    gate_up = torch.randn(4, 2 * 256, generator=g)
    torch.testing.assert_close(
        cpu_linear.silu_mul_linear(gate_up, big.float()),
        reference.silu_mul_linear(gate_up, big.float()), rtol=1e-5, atol=1e-4,
    )  # fmt: skip


def test_kernels_for_cpu_selects_onednn_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ops = kernels_for(torch.device("cpu"))
    assert ops.linear is cpu_linear.linear and ops.implementations["linear"] == "onednn"
    monkeypatch.setenv("METRALE_CPU_LINEAR", "torch")
    plain = kernels_for(torch.device("cpu"))
    assert plain.linear is reference.linear and plain.implementations["linear"] == "torch"
