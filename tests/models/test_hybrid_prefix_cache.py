"""Prefix caching on hybrid models: until SSM snapshots exist a KV prefix hit cannot be used,
so the cache is bypassed, with a warning at startup and a counted metric. Repeated prompts
(identical, and sharing long prefixes) give exactly the tokens of a cache-off run, no prompt
token is reported cached, and a KV prefix without its recurrent state is refused, never used
silently."""

from __future__ import annotations

import logging

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.helpers.checkpoints import HYBRID_VARIANTS, Variant, build

VARIANTS = [v for v in HYBRID_VARIANTS if v.name in ("nemotronh-moe", "qwen3next")]
PARAMS = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)


def repeated_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    system = torch.randint(6, 512, (40,), generator=g).tolist()
    tails = [torch.randint(6, 512, (n,), generator=g).tolist() for n in (3, 17)]
    return [system, system + tails[0], system, system + tails[1], system + tails[0]]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_cache_on_gives_cache_off_tokens_and_counts_the_bypass(
    variant: Variant, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(build(variant))
    with caplog.at_level(logging.WARNING, logger="metrale.model_engine.transformer_model"):
        on = LLM(path, device="cpu", num_kv_blocks=100, max_num_seqs=4)
    assert any("prefix caching is bypassed" in r.getMessage() for r in caplog.records)
    off = LLM(path, device="cpu", num_kv_blocks=100, max_num_seqs=4, enable_prefix_caching=False)
    prompts = repeated_prompts()
    # One at a time, so every repeat comes after its prefix was fully written and finished.
    got = [on.generate([p], PARAMS)[0] for p in prompts]
    ref = [off.generate([p], PARAMS)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert all(o.num_cached_tokens == 0 for o in got)
    model = on.engine.model
    assert model.prefix_cache_stats()["bypassed_lookups"] == len(prompts)
    assert off.engine.model.prefix_cache_stats()["bypassed_lookups"] == 0
    assert on.engine.scheduler.stats.prefix_hit_tokens == 0
    assert model.num_free_slots() == model.num_total_slots()


def test_a_kv_prefix_without_its_recurrent_state_is_refused() -> None:
    llm = LLM(str(build(VARIANTS[0])), device="cpu", num_kv_blocks=32, max_num_seqs=2)
    model = llm.engine.model
    prompt = repeated_prompts()[1]
    seq = model.alloc_sequence()
    # What a prefix hit without an SSM snapshot would hand over: KV for 16 tokens, no state.
    seq.block_table = model.block_pool.allocate(1)
    seq.tokens, seq.seq_len = list(prompt[:16]), 16
    with pytest.raises(ValueError, match="recurrent state"):
        model.prefill_chunk(prompt, seq, 16, len(prompt) - 16, True)
    model.free_sequence(seq)
    assert model.num_free_slots() == 2 and model.num_free_blocks() == model.num_total_blocks()
