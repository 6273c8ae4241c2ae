"""`KernelOps.linear` / `silu_mul_linear` on CUDA (`triton_linear`): few rows go to the GEMV
kernel, more rows to cuBLAS, and both equal the torch reference; a layer built on them gives
the reference layer's output.

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from metrale.kernels import KernelOps, reference
from metrale.kernels import triton_linear as tl_ops
from metrale.layers.common import GatedMLP

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("rows", [1, 3, tl_ops.GEMV_MAX_ROWS, tl_ops.GEMV_MAX_ROWS + 1, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(rows: int, bias: bool) -> None:
    dtype = torch.float32
    x = _rand(rows, 200, dtype=dtype, seed=1)
    w = _rand(130, 200, dtype=dtype, seed=2)
    b = _rand(130, dtype=dtype, seed=3) if bias else None
    torch.testing.assert_close(
        tl_ops.linear(x, w, b), reference.linear(x, w, b), rtol=1e-5, atol=1e-4
    )
    gu = _rand(rows, 400, dtype=dtype, seed=4)
    torch.testing.assert_close(
        tl_ops.silu_mul_linear(gu, w, b),
        reference.silu_mul_linear(gu, w, b),
        rtol=1e-5,
        atol=1e-4,
    )


def test_gated_mlp_on_the_cuda_ops_equals_the_reference() -> None:
    torch.manual_seed(0)
    cuda_ops = KernelOps(linear=tl_ops.linear, silu_mul_linear=tl_ops.silu_mul_linear)
    mlp = GatedMLP(64, 96, bias=False, act="silu", ops=cuda_ops).to(DEVICE)
    ref = GatedMLP(64, 96, bias=False, act="silu", ops=KernelOps()).to(DEVICE)
    ref.load_state_dict(mlp.state_dict())
    for rows in (1, 2, 9):
        x = _rand(rows, 64, dtype=torch.float32, seed=rows)
        torch.testing.assert_close(mlp(x), ref(x), rtol=1e-5, atol=1e-5)
