"""The small-M Triton GEMV (`triton_gemv.gemv`, `gemv_silu_mul`) against torch references.

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1` (small, ragged shapes; the Qwen3-8B shapes, every benchmark
candidate config and CUDA-graph capture need a GPU). Each output is checked two ways: against
`(x.float() @ w.float().T + bias).to(dtype)` elementwise (the result is rounded once from a
float32 accumulation, so it may differ from it by about one unit in the last place), and
against a float64 reference by `||out - ref|| / ||ref||`.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from metrale.kernels import reference
from metrale.kernels import triton_gemv as tg

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Relative norm error against float64 (dominated by the output rounding).
TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}
#: Elementwise bound against the rounded float32 reference: `RTOL * |ref|` (one or two ulps
#: of the output dtype) plus `ATOL * sum_k |x_k w_k|` (float32 summation-order noise).
RTOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-7}
ATOL = 2e-5
#: `(N, K)` pairs small enough for the interpreter, most of them ragged against every block.
SMALL_SHAPES = [(300, 1007), (33, 200), (1, 16), (5, 9), (64, 512)]
#: Qwen3-8B's decode GEMMs: qkv, o_proj, gate_up, down, lm_head.
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`out` against `x @ w.T + bias` computed in float32 (rounded) and in float64, on the
    device (the lm_head weight is 1.2 GB)."""
    dtype = x.dtype
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == dtype
    out64 = out.detach().double()
    assert torch.isfinite(out64).all(), "non-finite (unwritten or NaN) output elements"
    b32 = bias.float() if bias is not None else torch.zeros((), device=x.device)
    ref32 = (x.float() @ w.float().T + b32).to(dtype).double()
    x64, w64 = x.double(), w.double()
    scale = (x64.abs() @ w64.abs().T).clamp_min(1e-30)
    err = (out64 - ref32).abs()
    bound = RTOL[dtype] * ref32.abs() + ATOL * scale
    assert (err <= bound).all(), f"max excess {float((err - bound).max()):.3g}"
    ref64 = x64 @ w64.T + (b32.double() if bias is not None else 0.0)
    rel = float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))
    assert rel < TOL[dtype], rel


# -------------------------------------------------------------------------------------------
# Every backend (interpreter included)
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "k"), SMALL_SHAPES)
def test_gemv(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    g = gen(n * 31 + k + m)
    x = randn(m, k, dtype=dtype, g=g)
    w = randn(n, k, dtype=dtype, g=g, scale=k**-0.5)
    x_before, w_before = x.clone(), w.clone()
    check(tg.gemv(x, w), x, w, None)
    assert torch.equal(x, x_before) and torch.equal(w, w_before), "inputs are not written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_bias_and_strided_rows(dtype: torch.dtype, m: int) -> None:
    """Bias added in float32; x rows and W rows may be strided (views into wider tensors)."""
    g = gen(7)
    n, k = 77, 300
    x = randn(m, k + 20, dtype=dtype, g=g)[:, 5 : 5 + k]
    w = randn(n, k + 8, dtype=dtype, g=g, scale=k**-0.5)[:, :k]
    bias = randn(n, dtype=dtype, g=g)
    check(tg.gemv(x, w, bias), x, w, bias)


CONFIGS = [
    tg.GemvConfig(block_n=16, block_k=64, split_k=3),
    tg.GemvConfig(block_n=4, block_k=128, split_k=2, num_stages=1),
    tg.GemvConfig(block_n=32, block_k=32, split_k=1, num_warps=8),
    tg.GemvConfig(block_n=8, block_k=256, split_k=16, num_stages=4),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.describe())
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_configs(config: tg.GemvConfig, m: int, bias: bool) -> None:
    """Split-K (workspace + reduction, last split short, more splits than fit: capped) and
    tile shapes other than the heuristic's, on a ragged shape."""
    dtype = torch.bfloat16
    g = gen(11)
    n, k = 90, 1007
    x = randn(m, k, dtype=dtype, g=g)
    w = randn(n, k, dtype=dtype, g=g, scale=k**-0.5)
    b = randn(n, dtype=dtype, g=g) if bias else None
    check(tg.gemv(x, w, b, config=config), x, w, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("config", [None, CONFIGS[0]], ids=["default", "split"])
def test_gemv_silu_mul(dtype: torch.dtype, m: int, config: tg.GemvConfig | None) -> None:
    """Equals `gemv(silu_and_mul(gate_up))`: the activation is rounded like the reference."""
    g = gen(13 + m)
    n, inter = 70, 520
    gate_up = randn(m, 2 * inter, dtype=dtype, g=g, scale=2.0)
    w = randn(n, inter, dtype=dtype, g=g, scale=inter**-0.5)
    act = reference.silu_and_mul(gate_up.cpu()).to(DEVICE)
    check(tg.gemv_silu_mul(gate_up, w, config=config), act, w, None)


def test_gemv_rejects_bad_inputs() -> None:
    w = torch.zeros(8, 16, device=DEVICE)
    with pytest.raises(ValueError):
        tg.gemv(torch.zeros(9, 16, device=DEVICE), w)
    with pytest.raises(ValueError):
        tg.gemv(torch.zeros(1, 8, device=DEVICE), w)
    with pytest.raises(TypeError):
        tg.gemv(torch.zeros(1, 16, device=DEVICE, dtype=torch.float16), w)
    with pytest.raises(ValueError):
        tg.gemv(torch.zeros(1, 16, device=DEVICE), torch.zeros(16, 8, device=DEVICE).T)
    with pytest.raises(ValueError):
        tg.gemv_silu_mul(torch.zeros(1, 15, device=DEVICE), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_config_heuristic(dtype: torch.dtype) -> None:
    """The documented picks for Qwen3-8B, and the register budget for every M."""
    picks = {nk: tg.default_config(1, *nk, torch.bfloat16, 132) for nk in QWEN3_8B}
    assert [c.split_k for c in picks.values()] == [1, 1, 1, 1, 1]  # split-K lost on the H200
    assert all((c.block_n, c.block_k, c.num_stages) == (16, 512, 3) for c in picks.values())
    for m in range(1, tg.MAX_M + 1):
        for n, k in [*QWEN3_8B, *SMALL_SHAPES]:
            config = tg.default_config(m, n, k, dtype, 132)
            assert config.fits(m) and 1 <= config.split_k <= -(-k // config.block_k)
            candidates = tg.candidate_configs(m, n, k, dtype, 132)
            assert candidates[0] == config and all(c.fits(m) for c in candidates)


# -------------------------------------------------------------------------------------------
# CUDA only
# -------------------------------------------------------------------------------------------


def _cuda_only() -> None:
    if INTERPRET:
        pytest.skip("CUDA only (8B shapes, graphs)")


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B)
def test_gemv_qwen3_8b_shapes(m: int, n: int, k: int) -> None:
    _cuda_only()
    g = gen(n + m)
    x = randn(m, k, dtype=torch.bfloat16, g=g)
    w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(torch.bfloat16)
    check(tg.gemv(x, w), x, w, None)
    if (n, k) == (4096, 12288):
        gate_up = randn(m, 2 * k, dtype=torch.bfloat16, g=g, scale=2.0)
        act = reference.silu_and_mul(gate_up)
        check(tg.gemv_silu_mul(gate_up, w), act, w, None)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 12288)])
def test_gemv_benchmark_candidates(m: int, n: int, k: int) -> None:
    """Every config `tools/bench_gemv.py` may pick is correct."""
    _cuda_only()
    g = gen(m)
    x = randn(m, k, dtype=torch.bfloat16, g=g)
    w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(torch.bfloat16)
    for config in tg.candidate_configs(m, n, k, torch.bfloat16):
        check(tg.gemv(x, w, config=config), x, w, None)


@pytest.mark.parametrize("config", [None, CONFIGS[0]], ids=["default", "split"])
def test_gemv_cuda_graph_replay(config: tg.GemvConfig | None) -> None:
    """Capture once (split-K workspace from the graph pool), replay with new inputs."""
    _cuda_only()
    dtype, m, n, k = torch.bfloat16, 2, 4096, 4096
    g = gen(3)
    w = randn(n, k, dtype=dtype, g=g, scale=k**-0.5)
    bias = randn(n, dtype=dtype, g=g)
    x = torch.empty(m, k, dtype=dtype, device=DEVICE)
    gate_up = torch.empty(m, 2 * k, dtype=dtype, device=DEVICE)
    x.copy_(randn(m, k, dtype=dtype, g=g))
    gate_up.copy_(randn(m, 2 * k, dtype=dtype, g=g))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        tg.gemv(x, w, bias, config=config)
        tg.gemv_silu_mul(gate_up, w, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tg.gemv(x, w, bias, config=config)
        out_act = tg.gemv_silu_mul(gate_up, w, config=config)
    for seed in (4, 5):
        g = gen(seed)
        x.copy_(randn(m, k, dtype=dtype, g=g))
        gate_up.copy_(randn(m, 2 * k, dtype=dtype, g=g))
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, w, bias)
        check(out_act, reference.silu_and_mul(gate_up), w, None)
