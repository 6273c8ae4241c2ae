"""Structured output in the engine: every constrained output is valid, and a grammar changes
nothing it should not. With a JSON-schema grammar, 16 requests (greedy and seeded sampling)
give the same tokens with and without prefix caching, under a pool so tight that sequences
are preempted (recompute and swap), under async scheduling or not, and with speculation on
(drafts cut where the grammar refuses them, verified under the mask); a request waits
unadmitted while its grammar compiles on the worker thread, the others decoding; an
unconstrained request's tokens do not change when a constrained one runs beside it; a
grammar that terminates finishes the request ("stop")."""

from __future__ import annotations

import json

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.errors import InvalidRequestError
from metrale.sampling.structured import GrammarSpec
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "tags", "ok"],
    "additionalProperties": False,
}
SPEC = GrammarSpec.json_schema(SCHEMA, "response_format")


def workload(
    count: int = 16, spec: GrammarSpec | None = SPEC
) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    # A shared head so prefix caching has something to reuse.
    head = torch.randint(6, 512, (40,), generator=g).tolist()
    prompts = [
        head + torch.randint(6, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 12, (count,), generator=g)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=96, structured_outputs=spec)
        if i % 2 == 0
        else SamplingParams(temperature=1.0, max_tokens=96, seed=300 + i, structured_outputs=spec)
        for i in range(count)
    ]
    return prompts, params


def run(prompts: list[list[int]], params: list[SamplingParams], **kwargs: object) -> tuple:
    llm = LLM(str(build(VARIANT)), device="cpu", max_num_seqs=16, **kwargs)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], outs, llm


def test_constrained_outputs_parse_and_finish_with_stop() -> None:
    prompts, params = workload()
    _, outs, llm = run(prompts, params, num_kv_blocks=400)
    for out in outs:
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        value = json.loads(choice.text)
        assert set(value) == {"name", "n", "tags", "ok"} and 0 <= value["n"] <= 999
        # xgrammar counts a UTF-8-encoded surrogate (ED B5 80, which this random model
        # writes) as one character; Python decodes it to three U+FFFD.
        assert len(value["name"].replace("\ufffd" * 3, "?")) <= 6
        assert set(value["tags"]) <= {"a", "bb", "ccc"}
    backend = llm.engine.grammar_backend
    assert backend.compiles == 1 and backend.cache_hits == len(prompts) - 1
    assert not llm.engine._grammar_of  # every matcher released with its request
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_blocks": 400, "enable_prefix_caching": False},
        {"num_kv_blocks": 18, "preemption_mode": "recompute"},
        {"num_kv_blocks": 18, "preemption_mode": "swap"},
        {"num_kv_blocks": 400, "async_scheduling": False},
    ],
    ids=["no-prefix-cache", "preempt-recompute", "preempt-swap", "sync"],
)
def test_grammar_outputs_invariant(kwargs: dict) -> None:
    prompts, params = workload()
    reference, _, _ = run(prompts, params, num_kv_blocks=400)
    result, _, llm = run(prompts, params, **kwargs)
    assert result == reference
    stats = llm.engine.scheduler.stats
    if kwargs.get("preemption_mode") == "recompute":
        assert stats.preemptions_recompute > 0, "the pool is not tight"
    if kwargs.get("preemption_mode") == "swap":
        assert stats.preemptions_swap > 0, "the pool is not tight"
    assert_no_leaks(llm.engine)


def test_constrained_row_does_not_change_its_neighbours() -> None:
    prompts, free = workload(spec=None)
    alone, _, _ = run(prompts, free, num_kv_blocks=400)
    mixed_params = [p if i % 3 else p.replace(structured_outputs=SPEC) for i, p in enumerate(free)]
    mixed, outs, llm = run(prompts, mixed_params, num_kv_blocks=400)
    for i, (a, m) in enumerate(zip(alone, mixed)):
        if i % 3:
            assert m == a, f"unconstrained row {i} changed beside a JSON-schema row"
        else:
            json.loads(outs[i].outputs[0].text)
    # rows after a grammar row are fed on the device and sampled once the mask is known
    assert llm.engine.late_sampled_steps > 0
    assert llm.engine.grammar_rows_prefilled > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_under_a_grammar_is_lossless(method: str) -> None:
    prompts, params = workload(count=8)
    # Greedy rows repeat themselves, so n-gram drafts exist and some break the grammar.
    reference, _, _ = run(prompts, params, num_kv_blocks=400)
    spec = {"method": method, "num_speculative_tokens": 4, "gate": "off"}
    result, outs, llm = run(prompts, params, num_kv_blocks=400, speculative_config=spec)
    # Greedy rows: the same tokens; sampled rows: the same distribution (valid outputs).
    assert result[::2] == reference[::2]
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        json.loads(out.outputs[0].text)
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert llm.engine.grammar_drafts_cut > 0  # some drafts broke the grammar and were cut
    assert not llm.engine._grammar_of
    assert_no_leaks(llm.engine)


def test_other_constraint_kinds() -> None:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=200)
    cases = [
        (GrammarSpec.choice(["red", "green", "blue"], "guided_choice"), r"(red|green|blue)"),
        (GrammarSpec.text("regex", r"[a-c]{2}-[0-9]{3}", "guided_regex"), r"[a-c]{2}-[0-9]{3}"),
        (GrammarSpec.text("grammar", 'root ::= "x" ("y" | "z")+', "guided_grammar"), r"x[yz]+"),
    ]
    import re

    for spec, pattern in cases:
        params = SamplingParams(
            temperature=1.0, max_tokens=24, seed=7, n=4, structured_outputs=spec
        )
        (out,) = llm.generate([[9, 10, 11, 12]], params)
        for choice in out.outputs:
            if choice.finish_reason == "stop":
                assert re.fullmatch(pattern, choice.text), (spec.kind, choice.text)
            else:  # only an unbounded repetition may run out of tokens
                assert spec.kind == "grammar" and re.fullmatch(r"x[yz]*", choice.text)
    assert_no_leaks(llm.engine)


def test_refused_schema_names_the_construct_and_changes_nothing() -> None:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=64)
    bad = GrammarSpec.json_schema({"type": "strange"}, "response_format")
    with pytest.raises(InvalidRequestError, match='Unsupported type "strange"') as info:
        llm.generate([[9, 10, 11]], SamplingParams(max_tokens=4, structured_outputs=bad))
    assert info.value.param == "response_format"
    regex = GrammarSpec.text("regex", "(?<=a)b", "guided_regex")
    with pytest.raises(InvalidRequestError, match="Lookbehind"):
        llm.generate([[9, 10, 11]], SamplingParams(max_tokens=4, structured_outputs=regex))
    assert not llm.engine.has_unfinished()
    assert_no_leaks(llm.engine)


def test_compile_runs_off_the_step() -> None:
    """A request whose grammar is still compiling waits (not admitted) while the others
    decode, including those queued after it; once compiled it runs, and a compile of the same
    schema is shared."""
    import threading

    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=200)
    engine = llm.engine
    backend = engine.grammar_backend
    compile_for = backend._compile
    gate = threading.Event()

    def slow(spec: GrammarSpec, grammar: object) -> object:
        assert gate.wait(30)
        return compile_for(spec, grammar)

    backend._compile = slow  # type: ignore[method-assign]
    free = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    engine.add_request("free", [9, 10, 11], free)
    constrained = SamplingParams(temperature=0, max_tokens=96, structured_outputs=SPEC)
    engine.add_request("json-a", [9, 10, 12], constrained)
    engine.add_request("json-b", [9, 10, 13], constrained)
    engine.add_request("behind", [9, 10, 15], free)  # queued behind them: it goes past
    finished: dict[str, object] = {}
    for _ in range(12):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert "free" in finished and len(finished["free"].outputs[0].token_ids) == 6
    assert "behind" in finished and len(finished["behind"].outputs[0].token_ids) == 6
    assert not finished.keys() & {"json-a", "json-b"}
    assert backend.compiles == 1  # the second request shares the first one's compile
    engine.add_request("json-c", [9, 10, 14], constrained)
    engine.abort_request("json-c")  # aborted while compiling: nothing of it stays
    assert "json-c" not in engine._compiling
    gate.set()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for rid in ("json-a", "json-b"):
        json.loads(finished[rid].outputs[0].text)
    assert_no_leaks(engine)


def test_grammar_end_finishes_even_under_ignore_eos() -> None:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=64)
    spec = GrammarSpec.choice(["alpha", "beta"], "guided_choice")
    params = SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=32, ignore_eos=True, structured_outputs=spec
    )
    (out,) = llm.generate([[9, 10, 11]], params)
    for choice in out.outputs:
        assert choice.finish_reason == "stop" and choice.text in ("alpha", "beta")
        assert len(choice.token_ids) < 32
    assert_no_leaks(llm.engine)
