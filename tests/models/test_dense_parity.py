"""Dense architectures against transformers: greedy tokens identical and logprobs within 1e-4,
float32 on the CPU, for a batch of 8 prompts of 1 to 200 tokens, for every variant (tied
embeddings, GQA ratios 1/2/4, q/k norm, attention bias, explicit head_dim, sliding window,
each rope scaling kind, both config.json layouts)."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from tests.helpers.checkpoints import DENSE_VARIANTS, Variant, build, load_hf
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.parity import assert_matches, hf_greedy, mixed_prompts

NEW_TOKENS = 32


@pytest.mark.parametrize("variant", DENSE_VARIANTS, ids=lambda v: v.name)
def test_greedy_matches_transformers(variant: Variant) -> None:
    path = build(variant)
    prompts = mixed_prompts(8)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=160)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=5)
    outs = llm.generate(prompts, params)
    hf = load_hf(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert_matches(out, hf_greedy(hf, prompt, NEW_TOKENS))
    assert_no_leaks(llm.engine)


def test_sliding_window_variant_really_windows() -> None:
    """The mistral variant's window (48) is shorter than its longest prompts, so the parity
    test above exercises windowed attention, not a no-op."""
    variant = next(v for v in DENSE_VARIANTS if v.arch == "mistral")
    assert dict(variant.overrides)["sliding_window"] < max(len(p) for p in mixed_prompts(8))
