"""Data-parallel replicas on CUDA (needs 2 GPUs): `--data-parallel-size 2` puts replica i on
GPU i (each device's free memory drops by a model load, not just one of them), and each
request gets the tokens of one engine on one GPU. Marked `gpu`; skipped with fewer than 2
GPUs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig
from metrale.engine.engine_process import EngineProcess
from metrale.engine.replicas import ReplicatedEngine, build_replicas, replica_envs
from metrale.engine.supervisor import SupervisedEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["def fibonacci(n):\n", "import os\n\n", "class Stack:\n", "for i in range(10):\n"]
#: A replica's CUDA context and KV pool take far more than this on its device.
_LOAD_BYTES = 200 << 20


def test_replicas_take_one_gpu_each_with_one_engine_tokens() -> None:
    config = EngineConfig(device="cuda", dtype="float32", num_kv_blocks=300)
    free_before = [torch.cuda.mem_get_info(i)[0] for i in range(2)]
    envs = replica_envs("cuda", 2)
    assert len({e["CUDA_VISIBLE_DEVICES"] for e in envs}) == 2

    def factory(env: dict[str, str]):  # type: ignore[no-untyped-def]
        return lambda: SupervisedEngine(lambda: EngineProcess(config, child_env=env))

    engine = ReplicatedEngine(build_replicas([factory(env) for env in envs]))
    engine.start()
    try:
        used = [free_before[i] - torch.cuda.mem_get_info(i)[0] for i in range(2)]
        assert min(used) > _LOAD_BYTES, used
        reference = LLM(None, device="cuda", dtype="float32", num_kv_blocks=300)
        tokenizer = reference.get_tokenizer()

        async def one(rid: str, ids: list[int]) -> list[int]:
            stream = await engine.add_request(rid, None, PARAMS, prompt_token_ids=ids)
            last = None
            async for out in stream:
                last = out
            assert last is not None
            return list(last.outputs[0].token_ids)

        async def run() -> list[list[int]]:
            # One at a time, as the reference runs them: same batch shapes, same tokens.
            return [await one(f"r{i}", tokenizer.encode(p)) for i, p in enumerate(PROMPTS * 2)]

        got = asyncio.run(run())
        want = [
            list(reference.generate([tokenizer.encode(p)], PARAMS)[0].outputs[0].token_ids)
            for p in PROMPTS * 2
        ]
        assert got == want
        assert all(s.routed_prefix + s.routed_load > 0 for s in engine.replica_stats())
    finally:
        engine.shutdown()
