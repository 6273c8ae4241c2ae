"""Speculative decoding on CUDA: verify steps replay the (batch, k + 1) decode graphs, and the
greedy tokens track those of plain decoding on the same device and dtype. Marked `gpu`;
skipped without CUDA.

A verify step scores k + 1 rows per sequence where plain decoding scores one, so its GEMMs
and attention reduce in another order; on the GPU that can flip a near-tie (the seed notes
the same of its batched verify). So: float32 must be identical on nearly every prompt, and
wherever a prompt diverges the verify token must be among plain decoding's top 5 there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.helpers.parity import count_identical_or_near_ties
from tests.helpers.spec import ScriptedProposer

pytestmark = pytest.mark.gpu

NEW = 48
PARAMS = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW, logprobs=5)
PROMPTS = [
    "def fibonacci(n):\n", "import os\n\n", "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n", "# Copyright", "from typing import", "def main():\n    args = ",
    "try:\n    import json\nexcept ImportError:\n", "if __name__ == ", "x = [",
    "def read(path):\n    with open(path) as f:\n", "raise ValueError(",
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_verify_graphs_keep_greedy_tokens(dtype: str) -> None:
    off = LLM(None, device="cuda", dtype=dtype, num_kv_blocks=400)
    prompts = [off.get_tokenizer().encode(p) for p in PROMPTS]
    ref = off.generate(prompts, PARAMS)
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    on = LLM(
        None,
        device="cuda",
        dtype=dtype,
        num_kv_blocks=400,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "gate": "off"},
        proposer=ScriptedProposer(truth, wrong=0.3),
    )
    runner = on.engine.model.graph_runner
    assert runner is not None and (1, 5) in runner.graphs, "no verify graphs captured"
    before = runner.replays
    got = on.generate(prompts, PARAMS)
    assert runner.replays > before
    stats = on.engine.spec_stats
    assert stats.num_accepted_tokens > 0
    identical = count_identical_or_near_ties(ref, got)
    print(
        f"{dtype}: {identical}/{len(prompts)} prompts identical over {NEW} tokens; "
        f"acceptance {stats.acceptance_rate:.2f}, {stats.verify_steps} verify steps"
    )
    if dtype == "float32":
        assert identical >= len(prompts) - 1, f"only {identical}/{len(prompts)} identical"


def test_cuda_ngram_speculation_on_repetitive_text() -> None:
    """The real proposer on text that repeats: drafts are accepted, outputs unchanged."""
    text = "def add(a, b):\n    return a + b\n\n\n" * 3
    off = LLM(None, device="cuda", dtype="float32", num_kv_blocks=400)
    on = LLM(
        None,
        device="cuda",
        dtype="float32",
        num_kv_blocks=400,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "gate": "off"},
    )
    params = SamplingParams(temperature=0, max_tokens=64)
    assert [o.outputs[0].token_ids for o in on.generate([text], params)] == [
        o.outputs[0].token_ids for o in off.generate([text], params)
    ]
    assert on.engine.spec_stats.num_accepted_tokens > 0
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_mtp_speculation_keeps_greedy_tokens(dtype: str) -> None:
    """The bundled model's MTP head drafting on CUDA (head rows out of the decode and verify
    graphs, the head itself eager): outputs identical or near-tie divergences."""
    off = LLM(None, device="cuda", dtype=dtype, num_kv_blocks=400)
    prompts = [off.get_tokenizer().encode(p) for p in PROMPTS]
    ref = off.generate(prompts, PARAMS)
    on = LLM(
        None,
        device="cuda",
        dtype=dtype,
        num_kv_blocks=400,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3, "gate": "off"},
    )
    runner = on.engine.model.graph_runner
    assert runner is not None and runner.capture_head_hidden
    got = on.generate(prompts, PARAMS)
    stats = on.engine.spec_stats
    identical = count_identical_or_near_ties(ref, got)
    print(
        f"mtp {dtype}: {identical}/{len(prompts)} prompts identical over {NEW} tokens; "
        f"acceptance {stats.acceptance_rate:.2f} per position {stats.accepted_per_pos}, "
        f"{stats.verify_steps} verify steps"
    )
    assert stats.acceptance_rate > 0.2
    if dtype == "float32":
        assert identical >= len(prompts) - 1, f"only {identical}/{len(prompts)} identical"


def test_cuda_hybrid_speculation_with_an_mtp_head(tmp_path: Path) -> None:
    """A tiny Qwen3-Next with an MTP head on CUDA: the recurrent layers' token-by-token
    verify, the checkpoint and replay at commit, and the head drafting; greedy tokens equal
    plain decoding's (float32)."""
    from tests.helpers.checkpoints import HYBRID_VARIANTS
    from tests.helpers.mtp import with_mtp_head

    variant = next(v for v in HYBRID_VARIANTS if v.name == "qwen3next")
    path = str(with_mtp_head(variant, tmp_path / "qwen3next-mtp", 3))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(6, 500, (int(n),), generator=g).tolist() for n in (9, 23, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logprobs=5)
    ref = LLM(path, device="cuda", dtype="float32").generate(prompts, params)
    on = LLM(
        path,
        device="cuda",
        dtype="float32",
        speculative_config={"method": "mtp", "num_speculative_tokens": 2, "gate": "off"},
    )
    got = on.generate(prompts, params)
    stats = on.engine.spec_stats
    print(f"hybrid mtp: acceptance {stats.acceptance_rate:.2f}, {stats.verify_steps} verifies")
    assert stats.num_draft_tokens > 0
    assert count_identical_or_near_ties(ref, got) >= len(prompts) - 1
    # The random head's drafts are all rejected: scripted drafts give partial acceptance.
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, ref)}
    scripted = LLM(
        path,
        device="cuda",
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "gate": "off"},
        proposer=ScriptedProposer(truth, wrong=0.3),
    )
    got = scripted.generate(prompts, params)
    stats = scripted.engine.spec_stats
    print(f"hybrid scripted: acceptance {stats.acceptance_rate:.2f} {stats.accepted_per_pos}")
    assert 0 < stats.acceptance_rate < 1
    assert count_identical_or_near_ties(ref, got) >= len(prompts) - 1


def test_cuda_draft_model_speculation() -> None:
    """The bundled model drafting for itself on CUDA (its own eager pool beside the
    target's graphs): drafts are the target's own greedy tokens, so nearly all accepted."""
    from metrale.engine.engine import BUNDLED_MODEL_DIR

    off = LLM(None, device="cuda", dtype="float32", num_kv_blocks=400)
    prompts = [off.get_tokenizer().encode(p) for p in PROMPTS]
    ref = off.generate(prompts, PARAMS)
    on = LLM(
        None,
        device="cuda",
        dtype="float32",
        num_kv_blocks=400,
        speculative_config={
            "method": "draft_model", "model": str(BUNDLED_MODEL_DIR),
            "num_speculative_tokens": 4, "gate": "off",
        },
    )  # fmt: skip
    got = on.generate(prompts, PARAMS)
    stats = on.engine.spec_stats
    identical = count_identical_or_near_ties(ref, got)
    print(
        f"draft model: {identical}/{len(prompts)} identical, acceptance {stats.acceptance_rate:.3f}"
    )
    assert stats.acceptance_rate > 0.9
    assert identical >= len(prompts) - 1
