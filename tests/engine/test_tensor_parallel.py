"""Tensor and expert parallelism on the CPU: 2 ranks (rank 0 here, one spawned worker), gloo.

TP=2 greedy tokens equal TP=1's and transformers' with logprobs close, for a dense model
whose one KV head is replicated on both ranks, a biased model with tied embeddings, and a
Qwen3-MoE (experts' width sliced); EP=2 (whole experts per rank) equals TP=1 too. Refused
configurations fail at start-up naming the setting; a worker that dies ends the engine with
an error naming its rank.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig
from metrale.distributed.module import TensorParallelModule
from metrale.distributed.shard import ShardPlan
from metrale.errors import EngineDeadError, InvalidRequestError
from metrale.model_engine.factory import load_model
from metrale.models.config import parse_model_config
from tests.helpers.checkpoints import DENSE_VARIANTS, MOE_VARIANTS, Variant, build, load_hf
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.parity import assert_matches, hf_greedy, mixed_prompts

NEW_TOKENS = 12
KW: dict[str, Any] = dict(device="cpu", dtype="float32", num_kv_blocks=96, max_model_len=256)
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=3)


def _variant(name: str) -> Variant:
    return next(v for v in DENSE_VARIANTS + MOE_VARIANTS if v.name == name)


def _prompts() -> list[list[int]]:
    return [p[:40] for p in mixed_prompts(4, seed=3)]


def _tp_module(llm: LLM) -> TensorParallelModule:
    module = llm.engine.model.module  # type: ignore[attr-defined]
    assert isinstance(module, TensorParallelModule)
    return module


@pytest.fixture
def parallel_llms() -> Iterator[list[LLM]]:
    """Tensor-parallel LLMs a test opens, closed (workers joined) after it."""
    opened: list[LLM] = []
    yield opened
    for llm in opened:
        _tp_module(llm).close()


def _assert_same(ref: list[Any], got: list[Any], atol: float = 1e-4) -> None:
    for a, b in zip(ref, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for token, lp in la.items():
                assert abs(lp.logprob - lb[token].logprob) <= atol


def test_dense_tp2_replicated_kv_head_matches_tp1_and_transformers(
    parallel_llms: list[LLM],
) -> None:
    path = build(_variant("llama-gqa4-llama3"))  # 4 q heads, 1 KV head: replicated on 2 ranks
    prompts = _prompts()
    ref = LLM(str(path), **KW).generate(prompts, PARAMS)
    llm = LLM(str(path), tensor_parallel_size=2, **KW)
    parallel_llms.append(llm)
    assert llm.engine.model.kv_cache.num_kv_heads == 1  # type: ignore[attr-defined]
    got = llm.generate(prompts, PARAMS)
    _assert_same(ref, got)
    hf = load_hf(path)
    for prompt, out in zip(prompts, got, strict=True):
        assert_matches(out, hf_greedy(hf, prompt, NEW_TOKENS))
    assert_no_leaks(llm.engine)


def test_biased_tied_tp2_matches_tp1_then_a_dead_worker_is_named(
    parallel_llms: list[LLM],
) -> None:
    path = build(_variant("qwen2-bias-tied"))  # q/k/v bias, tied vocab-parallel LM head
    prompts = _prompts()
    ref = LLM(str(path), **KW).generate(prompts, PARAMS)
    llm = LLM(str(path), tensor_parallel_size=2, **KW)
    parallel_llms.append(llm)
    _assert_same(ref, llm.generate(prompts, PARAMS))
    module = _tp_module(llm)
    assert module.inner.model.embed_tokens.weight.shape[0] == 256  # half the vocabulary
    # The worker dies: the next step fails with an error naming it, not a hang.
    worker = module.health.__self__.procs[1]  # type: ignore[attr-defined]
    worker.kill()
    worker.wait()
    with pytest.raises(EngineDeadError, match="rank 1 exited"):
        llm.generate(prompts[:1], PARAMS)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_moe_parallel_matches_tp1(parallel_llms: list[LLM], expert_parallel: bool) -> None:
    path = build(_variant("qwen3moe-norm-dense1"))  # 8 experts, one dense layer
    prompts = _prompts()
    ref = LLM(str(path), **KW).generate(prompts, PARAMS)
    llm = LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **KW)
    parallel_llms.append(llm)
    experts = _tp_module(llm).inner.model.layers[0].mlp.experts.gate_up_proj
    # EP: 4 whole experts of width 2 x 32; TP: all 8 experts at half width.
    assert tuple(experts.shape[:2]) == ((4, 64) if expert_parallel else (8, 32))
    _assert_same(ref, llm.generate(prompts, PARAMS))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),  # 4 heads over 3 ranks
        ({"tensor_parallel_size": 2, "enable_lora": True}, "enable_lora"),
        ({"tensor_parallel_size": 2, "kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
        (
            {
                "tensor_parallel_size": 2,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            },
            "speculative_config",
        ),
        ({"tensor_parallel_size": 2, "preemption_mode": "swap"}, "preemption_mode"),
        ({"enable_expert_parallel": True}, "enable_expert_parallel"),
        ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, "enable_expert_parallel"),
    ],
)
def test_refused_configs_name_the_setting(kwargs: dict[str, Any], param: str) -> None:
    path = build(_variant("llama-gqa2"))  # dense: no experts to place
    with pytest.raises(InvalidRequestError) as err:
        LLM(str(path), **{**KW, **kwargs})
    assert err.value.param == param


def test_factory_refuses_tensor_parallel_without_its_launcher() -> None:
    path = build(_variant("llama-gqa2"))
    with pytest.raises(InvalidRequestError, match="load_tensor_parallel"):
        load_model(EngineConfig(model=str(path), tensor_parallel_size=2, **KW), str(path))


class _Handle:
    """A `safe_open` handle over tensors in memory (the slicing rules' unit tests)."""

    def __init__(self, tensors: dict[str, torch.Tensor], tmp: Path) -> None:
        from safetensors import safe_open

        save_file(tensors, str(tmp / "t.safetensors"))
        self._f = safe_open(str(tmp / "t.safetensors"), framework="pt")

    def get_slice(self, name: str) -> Any:
        return self._f.get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._f.get_tensor(name)


def test_plan_pads_the_last_vocab_slice_and_replicates_kv_heads(tmp_path: Path) -> None:
    raw = json.loads((build(_variant("llama-gqa4-llama3")) / "config.json").read_text())
    cfg = parse_model_config({**raw, "vocab_size": 10, "num_key_value_heads": 2}, "config.json")
    embed = torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4)
    k = torch.arange(2 * cfg.head_dim * 4, dtype=torch.float32).reshape(-1, 4)
    handle = _Handle({"model.embed_tokens.weight": embed, "l.self_attn.k_proj.weight": k}, tmp_path)
    d = cfg.head_dim
    for rank in range(4):  # 4 ranks: vocab 3 rows each (the last holds 1 + 2 zero rows)
        plan = ShardPlan.for_model(cfg, rank, 4)
        _, rows = plan.read("model.embed_tokens.weight", handle)  # type: ignore[misc]
        assert rows.shape == (3, 4)
        real = min(10, 3 * rank + 3) - 3 * rank
        assert torch.equal(rows[:real], embed[3 * rank : 3 * rank + real])
        assert not rows[real:].any()
        _, kv = plan.read("l.self_attn.k_proj.weight", handle)  # type: ignore[misc]
        head = rank // 2  # 2 KV heads over 4 ranks: each held by 2 ranks
        assert torch.equal(kv, k[head * d : (head + 1) * d])
