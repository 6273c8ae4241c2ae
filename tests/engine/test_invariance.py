"""Invariance: a prompt's greedy tokens do not depend on what ran beside it, on the prefill
chunk budget, or on arriving while other sequences decode (chunks sharing forwards with decode
rows); a seeded sampled request repeats whatever batch it lands in; every block comes back."""

from __future__ import annotations

import functools

import pytest

from metrale import LLM, Engine, EngineConfig, SamplingParams
from metrale.scheduler.plan import StepPlan
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.parity import mixed_prompts

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
GREEDY = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)


def make_llm(**kwargs: object) -> LLM:
    kwargs.setdefault("num_kv_blocks", 160)
    return LLM(str(build(VARIANT)), device="cpu", dtype="float32", **kwargs)


@functools.cache
def solo_tokens() -> tuple[tuple[int, ...], ...]:
    llm = make_llm()
    return tuple(tuple(llm.generate([p], GREEDY)[0].outputs[0].token_ids) for p in mixed_prompts(8))


def test_batch_of_eight_equals_each_alone() -> None:
    llm = make_llm()
    outs = llm.generate(mixed_prompts(8), GREEDY)
    assert tuple(tuple(o.outputs[0].token_ids) for o in outs) == solo_tokens()
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_prefill_chunk_budget_does_not_change_tokens(chunk: int) -> None:
    llm = make_llm(max_prefill_chunk=chunk)
    outs = llm.generate(mixed_prompts(8), GREEDY)
    assert tuple(tuple(o.outputs[0].token_ids) for o in outs) == solo_tokens()
    assert_no_leaks(llm.engine)


def test_token_budget_smaller_than_a_block_still_progresses() -> None:
    llm = make_llm(max_num_batched_tokens=9, max_num_seqs=8)
    outs = llm.generate(mixed_prompts(8), GREEDY)
    assert tuple(tuple(o.outputs[0].token_ids) for o in outs) == solo_tokens()


def test_arrivals_while_others_decode_share_forwards() -> None:
    engine = Engine(
        EngineConfig(model=str(build(VARIANT)), device="cpu", num_kv_blocks=160),
        max_prefill_chunk=16,
    )
    prompts = mixed_prompts(8)
    finals: dict[str, list[int]] = {}
    mixed_steps = 0
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], GREEDY)
    for _ in range(6):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    for i in range(4, 8):
        engine.add_request(f"r{i}", prompts[i], GREEDY)
    schedule = engine.scheduler.schedule

    def counting_schedule() -> StepPlan:
        nonlocal mixed_steps
        plan = schedule()
        mixed_steps += bool(plan.decode and plan.prefill)
        return plan

    engine.scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert mixed_steps > 0, "no step mixed decode rows with prefill chunks"
    assert tuple(tuple(finals[f"r{i}"]) for i in range(8)) == solo_tokens()
    assert_no_leaks(engine)


def test_seeded_sampling_repeats_across_batch_placements() -> None:
    llm = make_llm()
    prompts = mixed_prompts(8)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234)
    other = SamplingParams(temperature=1.0, max_tokens=24)
    alone = llm.generate([prompts[3]], seeded)[0].outputs[0].token_ids
    first = llm.generate([prompts[3], *prompts[:3]], [seeded, other, other, other])
    last = llm.generate([*prompts[4:], prompts[3]], [other, other, other, other, seeded])
    assert first[0].outputs[0].token_ids == alone
    assert last[-1].outputs[0].token_ids == alone
    unseeded = [o.outputs[0].token_ids for o in llm.generate([prompts[3]] * 4, other)]
    assert len({tuple(t) for t in unseeded}) > 1, "unseeded samples should differ"
    assert_no_leaks(llm.engine)


def test_n_choices_share_a_prompt_and_differ() -> None:
    llm = make_llm()
    out = llm.generate(
        [mixed_prompts(8)[2]], SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = llm.generate(
        [mixed_prompts(8)[2]], SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7)
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_text_is_the_decoded_tokens() -> None:
    llm = make_llm()
    tok = llm.get_tokenizer()
    for out in llm.generate(
        mixed_prompts(8), SamplingParams(temperature=1.0, max_tokens=40, seed=3)
    ):
        choice = out.outputs[0]
        assert choice.text == tok.decode(choice.token_ids)
