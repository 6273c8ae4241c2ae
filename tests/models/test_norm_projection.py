"""The layers' fused pre-norm entry (`layers.common.project_normed`): when the kernel ops
provide `add_rms_norm_linear`, the dense family's attention and MLP call it in place of the
norm and the projection, and nothing else changes.

The CPU has no fused kernel (`KernelOps.add_rms_norm_linear` is None there), so this test
gives the CPU ops one composed from the CPU's own norm and projection ops: the same
arithmetic in the same order, so the outputs must be identical, and the call count shows
the layers took the fused entry (both norms of every layer, prefill and the layer-path
decode). The CUDA kernel behind the op is tested in `tests/gpu/test_norm_gemv.py`.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import pytest

from metrale import LLM, SamplingParams
from metrale.model_engine import factory
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.parity import mixed_prompts


def _composed(ops: Any, calls: Counter) -> Any:
    def add_rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None):  # type: ignore[no-untyped-def]
        calls["fused"] += 1
        if residual is None:
            normed, summed = ops.rms_norm(x, norm_weight, eps), x
        else:
            normed, summed = ops.add_rms_norm(x, residual, norm_weight, eps)
        return ops.linear(normed, weight, bias), summed

    return add_rms_norm_linear


@pytest.mark.parametrize("name", ["qwen3-qknorm", "llama-headdim-yarn-bias"])
def test_fused_pre_norm_entry_changes_no_output(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = build(next(v for v in DENSE_VARIANTS if v.name == name))
    prompts = mixed_prompts(4)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=3)
    kwargs: dict[str, Any] = dict(device="cpu", dtype="float32", num_kv_blocks=96)
    base = LLM(str(path), **kwargs).generate(prompts, params)

    calls: Counter = Counter()
    real = factory.kernels_for

    def kernels_for(*args: Any, **kw: Any) -> Any:
        ops = real(*args, **kw)
        return dataclasses.replace(ops, add_rms_norm_linear=_composed(ops, calls))

    monkeypatch.setattr(factory, "kernels_for", kernels_for)
    llm = LLM(str(path), **kwargs)
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    fused = llm.generate(prompts, params)
    assert calls["fused"] >= 2 * layers, calls
    for a, b in zip(base, fused, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
