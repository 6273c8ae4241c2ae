"""The decode graph runner's persistent buffers and padding against the plain forward: every
Triton kernel on the decode path plus the runner give the reference path's greedy tokens.

On CUDA the runner captures real graphs (float32, so both sides round alike). Under
`METRALE_TRITON_INTERPRET=1` the same body runs uncaptured on the CPU through the interpreted
kernels, which checks the buffer, padding and null-block logic without a GPU."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.parity import mixed_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]


def test_runner_tokens_equal_the_reference_path() -> None:
    from metrale.kernels.triton_ops import triton_kernel_ops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    variant = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
    ref = LLM(str(build(variant)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    llm = LLM(str(build(variant)), device=device, dtype="float32", num_kv_blocks=300,
              max_num_seqs=8, enforce_eager=True)  # fmt: skip
    model = llm.engine.model
    if device == "cpu":  # route every op through the interpreted Triton kernels
        ops = triton_kernel_ops()
        for module in model.module.modules():
            if hasattr(module, "ops"):
                module.ops = ops
    runner = DecodeGraphRunner(model.module, model.kv_cache.layers, model.device, 8, 32, 16)
    if device == "cuda":
        runner.capture()
    model.graph_runner = runner
    eager_before = model.eager_forwards  # start-up shape warm-up forwards (CUDA) count too
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for batch in (mixed_prompts(5)[:1], mixed_prompts(5)):  # rungs 1 and 8 (5 padded)
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        want = [o.outputs[0].token_ids for o in ref.generate(batch, params)]
        assert got == want
    assert model.eager_forwards - eager_before == 2, "only the two prefills should run eagerly"
    assert llm.engine.fed_steps > 0, "no replay read its input tokens on the device"
