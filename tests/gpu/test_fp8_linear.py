"""The FP8-weight projections (`triton_fp8`: the GEMV for few rows, the W8A16 GEMM for many)
against their torch reference (`reference.linear_fp8`: dequantize in float32, round to x's
dtype, `F.linear`), for block and per-row scales; and the engine running an FP8 checkpoint
and `--quantization fp8` on CUDA.

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1`. The interpreter loads float8 tensors and converts them exactly,
but its `tl.dot` on bfloat16 operands returns garbage (Triton 3.x: checked with a 16x16 dot),
so interpreted cases use float32 activations; bf16/fp16 activations, the Qwen3-8B shapes,
CUDA-graph capture and the engine tests run on CUDA only.

Tolerance: the GEMV accumulates `fp8 * scale * x` in float32 (the block scale folded into x);
the GEMM multiplies the weight rounded as the reference rounds it (block scales) or scales
the sum (row scales), and beyond its rows runs the reference's own computation; the
reference multiplies the dequantized weight rounded to x's dtype. With float32 activations both are float32 sums of the
same products, so they agree to float32 summation noise (`ATOL * sum |x w|`); with bf16/fp16
the reference's weight rounding adds up to one unit of the activation dtype per product.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from metrale.kernels import reference
from metrale.kernels import triton_fp8 as tf

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

ROWS = [1, 2, 7, 64, 200, 300]
#: `(N, K)`: N not a multiple of any tile, K not a multiple of the GEMV's 512 or a block.
SHAPES = [(200, 300), (48, 160)]
BLOCKS = [None, (16, 16), (32, 64), (128, 128)]
ACT_DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16, torch.float16]
#: Relative to `sum_k |x_k w_k|`: float32 summation noise, or one ulp of bf16 / fp16.
ATOL = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _cuda_only() -> None:
    if INTERPRET:
        pytest.skip("CUDA only")


def _operands(
    m: int, n: int, k: int, block: tuple[int, int] | None, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    # Rows and columns of different magnitudes, so every block gets its own scale.
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, k)[None, :]
    w = w * torch.logspace(0, -1, n)[:, None]
    q, s = reference.quantize_fp8(w, block)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), bias.to(DEVICE)


def check(out: torch.Tensor, x: torch.Tensor, q, s, bias, block) -> None:  # type: ignore[no-untyped-def]
    ref = reference.linear_fp8(x, q, s, bias, block)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out.float()).all(), "non-finite (unwritten or NaN) output"
    w64 = reference.dequantize_fp8(q, s, block).double()
    scale = x.double().abs() @ w64.abs().T + 1.0
    err = (out.double() - ref.double()).abs()
    bound = ATOL[x.dtype] * scale + 2 * ATOL[x.dtype] * ref.double().abs()
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"


@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_linear_fp8_matches_reference(
    m: int, n: int, k: int, block: tuple[int, int] | None, dtype: torch.dtype
) -> None:
    """Through the op entry: M <= 8 takes the GEMV, the rest the GEMM."""
    if INTERPRET and m == 300 and block != (16, 16):
        pytest.skip("interpreter time: M = 300 runs with one block layout")
    if dtype != torch.float32 and block not in (None, (128, 128)):
        pytest.skip("compile time: bf16 / fp16 run the two layouts checkpoints use")
    x, q, s, bias = _operands(m, n, k, block, dtype, seed=m + n + k)
    check(tf.linear_fp8(x, q, s, bias, block), x, q, s, bias, block)
    check(tf.linear_fp8(x, q, s, None, block), x, q, s, None, block)


@pytest.mark.parametrize("block", [None, (16, 16)])
@pytest.mark.parametrize("m", [1, 2, 7, 64])
def test_both_kernels_at_every_row_count(m: int, block: tuple[int, int] | None) -> None:
    """The GEMM also at few rows and the GEMV at its limit: both are valid for any M they
    take, whichever the router picks."""
    x, q, s, bias = _operands(m, 72, 144, block, torch.float32, seed=m)
    check(tf.gemm_fp8(x, q, s, bias, block), x, q, s, bias, block)
    if m <= tf.FP8_GEMV_MAX_ROWS:
        check(tf.gemv_fp8(x, q, s, bias, block), x, q, s, bias, block)


@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("block", [None, (16, 16), (128, 128)])
@pytest.mark.parametrize("m", [1, 2, 7, 64])
def test_silu_mul_linear_fp8_matches_reference(
    m: int, block: tuple[int, int] | None, dtype: torch.dtype
) -> None:
    _, q, s, bias = _operands(m, 96, 160, block, dtype, seed=7 * m)
    g = torch.Generator().manual_seed(m)
    gate_up = (torch.randn(m, 320, generator=g) * 2).to(dtype).to(DEVICE)
    out = tf.silu_mul_linear_fp8(gate_up, q, s, bias, block)
    # The stated bound (as every FP8 case here), not `assert_close`'s bf16 defaults: the fused
    # kernel rounds SiLU-and-multiply once (as `triton_norm.silu_and_mul`), the torch reference
    # twice, so a sum over a few hundred products moves by an ulp or two of a large output (on
    # the H200 every bf16/fp16 case tripped the defaults' 1e-5 absolute floor near zero).
    check(out, reference.silu_and_mul(gate_up), q, s, bias, block)


def test_fp8_kernels_reject_bad_inputs() -> None:
    x, q, s, _ = _operands(2, 32, 64, (16, 16), torch.float32, seed=0)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        tf.linear_fp8(x, q.float(), s, None, (16, 16))
    with pytest.raises(ValueError, match="bad shapes"):
        tf.linear_fp8(x[:, :48], q, s, None, (16, 16))
    with pytest.raises(ValueError, match="powers of two"):
        tf.gemm_fp8(x, q, s, None, (24, 16))
    assert tf.block_supported((128, 128)) and tf.block_supported(None)
    assert not tf.block_supported((8, 128))


def test_gated_mlp_with_fp8_projections_equals_the_reference_layer() -> None:
    """A `GatedMLP` converted to `Fp8Linear` on the Triton ops equals the same layer on the
    reference ops (the layer-side routing: fused gate_up, fused SiLU-and-mul down)."""
    from metrale.kernels import KernelOps
    from metrale.layers.common import GatedMLP
    from metrale.layers.fp8_linear import Fp8Linear, convert_projections

    torch.manual_seed(0)
    triton_ops = KernelOps(linear_fp8=tf.linear_fp8, silu_mul_linear_fp8=tf.silu_mul_linear_fp8)
    mlp = GatedMLP(64, 96, False, "silu", triton_ops).to(DEVICE)
    assert convert_projections(mlp, triton_ops, (16, 16), quantize=True).converted == 2
    assert isinstance(mlp.down_proj, Fp8Linear)
    x = torch.randn(5, 64).to(DEVICE)
    out = mlp(x)
    for proj in (mlp.gate_up_proj, mlp.down_proj):
        proj.ops = KernelOps()
    torch.testing.assert_close(out, mlp(x), rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------
# CUDA only
# -------------------------------------------------------------------------------------------

#: Qwen3-8B's projections `(N, K)`: qkv, o_proj, gate_up, down.
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("m", [1, 2, 8, 300])
@pytest.mark.parametrize(("n", "k"), QWEN3_8B)
def test_linear_fp8_qwen3_8b_shapes(m: int, n: int, k: int, block) -> None:  # type: ignore[no-untyped-def]
    _cuda_only()
    g = torch.Generator(device=DEVICE).manual_seed(m + n)
    w = torch.randn(n, k, device=DEVICE, generator=g) * k**-0.5
    q, s = reference.quantize_fp8(w, block)
    x = torch.randn(m, k, device=DEVICE, generator=g).to(torch.bfloat16)
    check(tf.linear_fp8(x, q, s, None, block), x, q, s, None, block)


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_decode_projection_cuda_graph_replay(block) -> None:  # type: ignore[no-untyped-def]
    """Capture the GEMV (PDL launch), the fused SiLU-mul GEMV and the GEMM once; replay with
    new inputs: no host sync, no allocation but the outputs."""
    _cuda_only()
    dtype, n, k = torch.bfloat16, 4096, 4096
    w = torch.randn(n, k, device=DEVICE) * k**-0.5
    q, s = reference.quantize_fp8(w, block)
    x = torch.empty(2, k, dtype=dtype, device=DEVICE)
    gate_up = torch.empty(2, 2 * k, dtype=dtype, device=DEVICE)
    big = torch.empty(64, k, dtype=dtype, device=DEVICE)
    for t in (x, gate_up, big):
        t.normal_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        tf.linear_fp8(x, q, s, None, block, pdl=True)
        tf.silu_mul_linear_fp8(gate_up, q, s, None, block)
        tf.linear_fp8(big, q, s, None, block)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tf.linear_fp8(x, q, s, None, block, pdl=True)
        out_act = tf.silu_mul_linear_fp8(gate_up, q, s, None, block)
        out_big = tf.linear_fp8(big, q, s, None, block)
    for _ in range(2):
        for t in (x, gate_up, big):
            t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, q, s, None, block)
        check(out_act, reference.silu_and_mul(gate_up), q, s, None, block)
        check(out_big, big, q, s, None, block)


def test_fp8_block_checkpoint_on_cuda_tracks_the_cpu_dequantized_run(tmp_path: Path) -> None:
    """Engine level: the FP8 block-quantized test checkpoint on CUDA (weights kept in FP8,
    float32 activations) against the CPU run, which dequantizes at load. Float32 on both
    sides, so the FP8 kernels are the main difference: at least 90% of prompts give identical
    greedy tokens, and every other one first diverges on one of the CPU's top-5 tokens (a
    near tie of the random tiny model)."""
    _cuda_only()
    from metrale import LLM, SamplingParams
    from metrale.layers.fp8_linear import Fp8Linear
    from tests.helpers.parity import count_identical_or_near_ties, mixed_prompts
    from tests.models.test_quantized import fp8_checkpoint

    fp8, _ = fp8_checkpoint(tmp_path, "block")
    prompts = mixed_prompts(12)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=5)
    cpu = LLM(str(fp8), device="cpu", dtype="float32", num_kv_blocks=300)
    gpu = LLM(str(fp8), device="cuda", dtype="float32", num_kv_blocks=300, max_num_seqs=16)
    assert any(isinstance(m, Fp8Linear) for m in gpu.engine.model.module.modules())
    assert gpu.engine.load_report.weight_dtype.startswith("fp8 e4m3 (block 16x16")
    assert cpu.engine.load_report.weight_dtype.startswith("float32 (dequantized")
    identical = count_identical_or_near_ties(
        cpu.generate(prompts, params), gpu.generate(prompts, params)
    )
    assert identical >= 0.9 * len(prompts), f"only {identical}/{len(prompts)} identical"


@pytest.mark.parametrize(
    ("method", "scales"), [("fp8", "per-channel"), ("fp8-block", "block 128x128")]
)
def test_online_fp8_quantization_on_cuda(method: str, scales: str) -> None:
    """`--quantization fp8` (per-row scales) and `fp8-block` (128x128 block scales) on the
    bundled trained model (real margins): the projections are FP8 with those scales, the
    weights take fewer bytes, and the bf16 run's greedy tokens are kept or first left at one
    of its top-5 tokens."""
    _cuda_only()
    from metrale import LLM, SamplingParams
    from tests.helpers.parity import count_identical_or_near_ties

    texts = ["def fibonacci(n):\n", "import os\n\n", "class Stack:\n", "for i in range(10):\n",
             "# Copyright", "from typing import", "def main():\n", "x = ["]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, logprobs=5)
    base = LLM(None, device="cuda", dtype="bfloat16", num_kv_blocks=300)
    fp8 = LLM(None, device="cuda", dtype="bfloat16", num_kv_blocks=300, quantization=method)
    assert fp8.engine.load_report.weight_dtype.startswith(f"fp8 e4m3 ({scales}")
    assert fp8.engine.load_report.weights_bytes < base.engine.load_report.weights_bytes
    prompts = [base.get_tokenizer().encode(t) for t in texts]
    identical = count_identical_or_near_ties(
        base.generate(prompts, params), fp8.generate(prompts, params)
    )
    print(f"fp8 vs bf16: {identical}/{len(prompts)} identical")
