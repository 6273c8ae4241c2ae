"""The pre-norm fused into the decode projections (`triton_gemv.gemv_norm`,
`triton_fp8.gemv_fp8_norm`, and the ops `triton_linear.add_rms_norm_linear` /
`triton_fp8.add_rms_norm_linear_fp8`) against `reference.add_rms_norm_linear[_fp8]`.

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1` (float32 activations there: the FP8 GEMM's bf16 dot is wrong
in the interpreter; the Qwen3-8B shapes and CUDA-graph capture need a GPU).

What is compared: the returned residual sum must equal the reference's bit for bit (both
round `residual + x` once to the dtype). The projection is compared with the reference's
normalised rows as its input: in float32 to summation noise; in bf16/fp16 the kernel's
float32 sum of squares may differ in order, so a normalised element may round to the
neighbouring value, which the bound allows (one unit of the dtype per product, as
`test_fp8_linear`'s) next to a tight relative-norm check against float64.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from metrale.kernels import reference
from metrale.kernels import triton_fp8 as tf
from metrale.kernels import triton_gemv as tg
from metrale.kernels import triton_linear as tl_

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16, torch.float16]
#: Per product, relative to `sum_k |x_k w_k|`: float32 summation noise or one unit of the dtype.
ATOL = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}
#: `||out - ref64|| / ||ref64||` (dominated by the output rounding).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
#: `(N, K)`: ragged against every tile; K below, at and above the norm prologue's 4096-column block.
SHAPES = [(300, 1007), (33, 200), (64, 512), (40, 4500)]


def _cuda_only() -> None:
    if INTERPRET:
        pytest.skip("CUDA only")


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """x (a sublayer's output), the residual stream (larger, as in a model), norm weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    residual = torch.randn(m, k, generator=g) * 4.0
    norm_weight = 1.0 + 0.2 * torch.randn(k, generator=g)
    return tuple(t.to(dtype).to(DEVICE) for t in (x, residual, norm_weight))


def check(
    out: torch.Tensor,
    normed: torch.Tensor,
    w: torch.Tensor,
    ref: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> None:
    """`out` against `ref` (the reference's projection of `normed`), `w` the weight the
    reference multiplied (dequantized for FP8)."""
    dtype = normed.dtype
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all(), "non-finite (unwritten or NaN) output"
    scale = normed.double().abs() @ w.double().abs().T + 1e-30
    err = (out.double() - ref.double()).abs()
    bound = ATOL[dtype] * scale + 2 * ATOL[dtype] * ref.double().abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"
    ref64 = normed.double() @ w.double().T + (bias.double() if bias is not None else 0.0)
    rel = float((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30))
    assert rel < TOL[dtype], rel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemv_norm_matches_reference(
    dtype: torch.dtype, with_residual: bool, m: int, n: int, k: int
) -> None:
    x, residual, nw = _rows(m, k, dtype, seed=n + k + m)
    if not with_residual:
        residual = None
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE) if m == 2 else None
    before = [t.clone() for t in (x, nw) + ((residual,) if residual is not None else ())]
    out, summed = tg.gemv_norm(x, residual, nw, 1e-6, w, bias)
    ref, ref_summed = reference.add_rms_norm_linear(x, residual, nw, 1e-6, w, bias)
    assert torch.equal(summed, ref_summed)
    check(out, reference.rms_norm(ref_summed, nw, 1e-6), w, ref, bias)
    for t, t0 in zip((x, nw) + ((residual,) if residual is not None else ()), before, strict=True):
        assert torch.equal(t, t0), "an input was written"


@pytest.mark.parametrize("block", [None, (32, 64), (128, 128)])
@pytest.mark.parametrize("m", [1, 2, 7])
@pytest.mark.parametrize(("n", "k"), [(200, 300), (256, 512)])
def test_gemv_fp8_norm_matches_reference(block, m: int, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    x, residual, nw = _rows(m, k, dtype, seed=3 * n + k + m)
    g = torch.Generator().manual_seed(n)
    q, s = reference.quantize_fp8(torch.randn(n, k, generator=g) * k**-0.5, block)
    q, s = q.to(DEVICE), s.to(DEVICE)
    out, summed = tf.gemv_fp8_norm(x, residual, nw, 1e-6, q, s, None, block)
    ref, ref_summed = reference.add_rms_norm_linear_fp8(x, residual, nw, 1e-6, q, s, None, block)
    assert torch.equal(summed, ref_summed)
    w = reference.dequantize_fp8(q, s, block).to(dtype)
    check(out, reference.rms_norm(ref_summed, nw, 1e-6), w, ref)


@pytest.mark.parametrize("m", [1, 2, 5, 40])
def test_ops_fuse_few_rows_and_compose_the_rest(m: int) -> None:
    """The ops take the fused GEMV up to their GEMV rows and the norm kernel + projection
    beyond; both agree with the reference, first layer (no residual) included."""
    dtype = torch.float32
    n, k = 96, 256
    x, residual, nw = _rows(m, k, dtype, seed=m)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(DEVICE)
    q, s = reference.quantize_fp8(w.cpu(), (32, 64))
    q, s = q.to(DEVICE), s.to(DEVICE)
    for res in (residual, None):
        out, summed = tl_.add_rms_norm_linear(x, res, nw, 1e-5, w)
        ref, ref_summed = reference.add_rms_norm_linear(x, res, nw, 1e-5, w)
        assert torch.equal(summed, ref_summed)
        check(out, reference.rms_norm(ref_summed, nw, 1e-5), w, ref)
        out, summed = tf.add_rms_norm_linear_fp8(x, res, nw, 1e-5, q, s, None, (32, 64))
        ref, ref_summed = reference.add_rms_norm_linear_fp8(x, res, nw, 1e-5, q, s, None, (32, 64))
        assert torch.equal(summed, ref_summed)
        wq = reference.dequantize_fp8(q, s, (32, 64))
        check(out, reference.rms_norm(ref_summed, nw, 1e-5), wq, ref)


def test_gemv_norm_rejects_mismatched_inputs() -> None:
    x, residual, nw = _rows(2, 64, torch.float32, seed=1)
    w = torch.randn(32, 64).to(DEVICE)
    with pytest.raises(ValueError, match="residual"):
        tg.gemv_norm(x, residual[:1], nw, 1e-6, w)
    with pytest.raises(ValueError, match="norm weight"):
        tg.gemv_norm(x, residual, nw[:32], 1e-6, w)
    with pytest.raises(ValueError, match="norm weight"):
        tg.gemv_norm(x, residual, nw.double(), 1e-6, w)


@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (24576, 4096)])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_norm_qwen3_8b_shapes(m: int, n: int, k: int) -> None:
    """qkv and gate_up at Qwen3-8B's width, bf16, with both scale layouts for FP8."""
    _cuda_only()
    x, residual, nw = _rows(m, k, torch.bfloat16, seed=n + m)
    w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(torch.bfloat16)
    out, summed = tg.gemv_norm(x, residual, nw, 1e-6, w, pdl=True)
    ref, ref_summed = reference.add_rms_norm_linear(x, residual, nw, 1e-6, w)
    assert torch.equal(summed, ref_summed)
    check(out, reference.rms_norm(ref_summed, nw, 1e-6), w, ref)
    for block in (None, (128, 128)):
        q, s = reference.quantize_fp8(w.float(), block)
        out, summed = tf.gemv_fp8_norm(x, residual, nw, 1e-6, q, s, None, block, pdl=True)
        ref, _ = reference.add_rms_norm_linear_fp8(x, residual, nw, 1e-6, q, s, None, block)
        wq = reference.dequantize_fp8(q, s, block).to(torch.bfloat16)
        check(out, reference.rms_norm(ref_summed, nw, 1e-6), wq, ref)


def test_gemv_norm_cuda_graph_replay() -> None:
    """Captured once with PDL launches (the norm GEMV after another kernel writes its x),
    replayed with new inputs."""
    _cuda_only()
    dtype, m, n, k = torch.bfloat16, 2, 4096, 4096
    x, residual, nw = _rows(m, k, dtype, seed=11)
    w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(dtype)
    src = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        tg.gemv_norm(src * 1.0, residual, nw, 1e-6, w, pdl=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x_in = src * 1.0  # a kernel writing x just before the PDL launch reads it
        out, summed = tg.gemv_norm(x_in, residual, nw, 1e-6, w, pdl=True)
    for seed in (4, 5):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        src.copy_(torch.randn(m, k, device=DEVICE, generator=g).to(dtype))
        residual.copy_(torch.randn(m, k, device=DEVICE, generator=g).to(dtype) * 4)
        graph.replay()
        torch.cuda.synchronize()
        ref, ref_summed = reference.add_rms_norm_linear(src, residual, nw, 1e-6, w)
        assert torch.equal(summed, ref_summed)
        check(out, reference.rms_norm(ref_summed, nw, 1e-6), w, ref)
