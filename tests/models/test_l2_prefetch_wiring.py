"""The dense layers' L2 prefetch hook (`KernelOps.prefetch_l2`, an experiment on CUDA): after
its QKV projection each attention block hands the op the weights its layer reads next,
o_proj's then the MLP's, with the forward's row count; and the hook changes no output.

The CPU has no prefetch (`prefetch_l2` is None there), so the test gives the CPU ops a spy
that records its calls. The CUDA kernel is tested in `tests/gpu/test_prefetch.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from metrale import LLM, SamplingParams
from metrale.model_engine import factory
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.parity import mixed_prompts


def test_attention_hands_the_next_weights_to_the_prefetch_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = build(next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm"))
    prompts = mixed_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2)
    kwargs: dict[str, Any] = dict(device="cpu", dtype="float32", num_kv_blocks=96)
    base = LLM(str(path), **kwargs).generate(prompts, params)

    calls: list[tuple[int, list[tuple[int, ...]]]] = []
    real = factory.kernels_for

    def kernels_for(*args: Any, **kw: Any) -> Any:
        ops = real(*args, **kw)
        record = lambda rows, weights: calls.append((rows, [tuple(w.shape) for w in weights]))  # noqa: E731
        return dataclasses.replace(ops, prefetch_l2=record)

    monkeypatch.setattr(factory, "kernels_for", kernels_for)
    llm = LLM(str(path), **kwargs)
    got = llm.generate(prompts, params)
    layers = llm.engine.model.module.model.layers  # type: ignore[attr-defined]
    first = layers[0]
    expected = [
        tuple(first.self_attn.o_proj.weight.shape),
        tuple(first.mlp.gate_up_proj.weight.shape),
        tuple(first.mlp.down_proj.weight.shape),
    ]
    assert calls, "the attention blocks never called prefetch_l2"
    assert all(shapes == expected for _, shapes in calls)
    assert len(calls) % len(layers) == 0 and {rows for rows, _ in calls} - {0}
    for a, b in zip(base, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
