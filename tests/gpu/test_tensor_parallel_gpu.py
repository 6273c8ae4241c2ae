"""Tensor and expert parallelism on CUDA (NCCL): TP=2 / EP=2 against TP=1 in float32 on two
GPUs of one host. Marked `gpu`; skipped without CUDA or with fewer than two devices (NCCL
refuses two ranks on one GPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.helpers.checkpoints import DENSE_VARIANTS, MOE_VARIANTS, build
from tests.helpers.parity import mixed_prompts

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

KW: dict[str, Any] = dict(device="cuda", dtype="float32", num_kv_blocks=96, max_model_len=256)
PARAMS = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=3)


@pytest.mark.parametrize(
    ("name", "expert_parallel"),
    [("llama-gqa4-llama3", False), ("qwen3moe-norm-dense1", False), ("qwen3moe-norm-dense1", True)],
)
def test_tp2_on_two_gpus_matches_tp1(name: str, expert_parallel: bool) -> None:
    variant = next(v for v in DENSE_VARIANTS + MOE_VARIANTS if v.name == name)
    path = str(build(variant))
    prompts = [p[:40] for p in mixed_prompts(4, seed=3)]
    ref = LLM(path, **KW).generate(prompts, PARAMS)
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **KW)
    try:
        got = llm.generate(prompts, PARAMS)
    finally:
        llm.engine.model.module.close()  # type: ignore[attr-defined]
    for a, b in zip(ref, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token, lp in la.items():
                assert abs(lp.logprob - lb[token].logprob) <= 1e-3
