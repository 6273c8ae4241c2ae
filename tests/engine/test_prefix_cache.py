"""Prefix cache: the same greedy tokens with the cache on and off for requests that share
system prompts (exact prefixes of each other, identical prompts, divergence mid-block);
`num_cached_tokens` equals the block-aligned shared length, minus the recomputed last token
when the whole prompt matched; adapters never share blocks; prompt-logprob requests bypass it."""

from __future__ import annotations

import torch

from metrale import LLM, Engine, EngineConfig, SamplingParams
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.lora import ADAPTER_A, ADAPTER_B, build_adapter

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)


def shared_prompts() -> list[list[int]]:
    """32 prompts over 3 system prompts of several lengths, with exact prefixes of each other,
    identical prompts, and tails that diverge mid-block."""
    g = torch.Generator().manual_seed(5)
    systems = [torch.randint(6, 512, (n,), generator=g).tolist() for n in (16, 37, 70)]
    prompts: list[list[int]] = []
    for i in range(32):
        base = systems[i % 3]
        kind = i % 4
        if kind == 0:
            prompts.append(list(base))  # identical to the system prompt itself
        elif kind == 1:
            prompts.append(base[: len(base) - 5])  # an exact prefix of another prompt
        else:
            tail = torch.randint(6, 512, (3 + i % 11,), generator=g).tolist()
            prompts.append(base + tail)  # diverges right after the shared part (mid-block)
    return prompts


def make(**kwargs: object) -> LLM:
    return LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=300, **kwargs)


def expected_cached(prompt: list[int], history: list[list[int]]) -> int:
    """What the cache can serve `prompt` after `history` (each finished sequence's KV-valid
    tokens) was inserted: the longest block-aligned common prefix, minus one token when that
    covers the whole prompt."""
    best = 0
    for seen in history:
        n = 0
        while n < min(len(prompt), len(seen)) and prompt[n] == seen[n]:
            n += 1
        aligned = n // BLOCK * BLOCK
        best = max(best, len(prompt) - 1 if aligned == len(prompt) else aligned)
    return best


def test_cache_on_and_off_give_the_same_tokens_and_exact_cached_counts() -> None:
    prompts = shared_prompts()
    on, off = make(), make(enable_prefix_caching=False)
    history: list[list[int]] = []
    for prompt in prompts:  # one at a time: the history at each admission is known exactly
        got = on.generate([prompt], PARAMS)[0]
        ref = off.generate([prompt], PARAMS)[0]
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert ref.num_cached_tokens == 0
        assert got.num_cached_tokens == expected_cached(prompt, history), prompt
        history.append(prompt + got.outputs[0].token_ids[:-1])
    hits = on.engine.scheduler.stats
    assert hits.prefix_hit_requests >= 24 and hits.prefix_hit_tokens > 500
    assert_no_leaks(on.engine)


def test_concurrent_shared_prompts_match_cache_off() -> None:
    prompts = shared_prompts()
    on, off = make(max_num_seqs=6), make(max_num_seqs=6, enable_prefix_caching=False)
    got = on.generate(prompts, PARAMS)
    ref = off.generate(prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.num_cached_tokens for o in got) > 0
    assert_no_leaks(on.engine)


def test_adapters_never_share_blocks() -> None:
    base = build(VARIANT)
    engine = Engine(
        EngineConfig(model=str(base), device="cpu", num_kv_blocks=100, enable_lora=True)
    )
    first = engine.load_lora_adapter("a", str(build_adapter(base, ADAPTER_A)))
    second = engine.load_lora_adapter("b", str(build_adapter(base, ADAPTER_B)))
    assert (first, second) == (1, 2)
    prompt = shared_prompts()[2]

    def run(rid: str, adapter: int) -> int:
        engine.add_request(rid, prompt, PARAMS, adapter_id=adapter)
        cached = 0
        while engine.has_unfinished():
            for out in engine.step():
                cached = out.num_cached_tokens
        return cached

    assert run("base", 0) == 0
    assert run("adapter-1", 1) == 0  # same tokens, other namespace: no hit
    assert run("adapter-1-again", 1) == len(prompt) // BLOCK * BLOCK
    assert run("adapter-2", 2) == 0
    assert run("base-again", 0) == len(prompt) // BLOCK * BLOCK
    assert_no_leaks(engine)


def test_prompt_logprob_requests_bypass_the_cache() -> None:
    on, off = make(), make(enable_prefix_caching=False)
    prompt = shared_prompts()[2]
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    on.generate([prompt], PARAMS)  # warm the cache with this exact prompt
    got = on.generate([prompt], scored)[0]
    ref = off.generate([prompt], scored)[0]
    assert got.num_cached_tokens == 0
    assert got.prompt_logprobs is not None and ref.prompt_logprobs is not None
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] is None
    for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None and a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
