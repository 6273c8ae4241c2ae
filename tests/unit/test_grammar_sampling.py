"""The grammar stage of the sampler, on the bundled tokenizer and random logits: the mask is
exactly xgrammar's (its own `apply_token_bitmask_inplace`), a greedy grammar row is the masked
argmax, rows without a grammar get the tokens they get without one, matcher sync is idempotent
and rolls back over diverged (rejected-draft) tokens, drafts are cut at the first refused one, a rejected token makes the row unsamplable (never the batch)."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from metrale.engine.intake import BUNDLED_MODEL_DIR
from metrale.errors import InvalidRequestError
from metrale.sampling.grammar import GrammarBackend, GrammarState, apply_grammar_masks
from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import Sampler, SamplingRow
from metrale.sampling.structured import GrammarSpec
from metrale.tokenizer.tokenizer import Tokenizer

VOCAB = 8192


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(BUNDLED_MODEL_DIR)


@pytest.fixture(scope="module")
def backend(tokenizer: Tokenizer) -> GrammarBackend:
    return GrammarBackend(tokenizer, VOCAB, tokenizer.eos_token_ids)


SPEC = GrammarSpec.json_schema(
    {"type": "object", "properties": {"k": {"enum": ["yes", "no"]}}, "required": ["k"]}, "x"
)


def test_mask_equals_xgrammars_own(backend: GrammarBackend, tokenizer: Tokenizer) -> None:
    state = backend.state(SPEC)
    prefix = tokenizer.encode('{"k": "', add_special_tokens=False)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    masked = apply_grammar_masks(logits, [1], [state], [prefix])
    expected = logits[1:2].clone()
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    state.fill(bitmask, 0)
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    torch.testing.assert_close(masked[1:2], expected, rtol=0, atol=0)
    torch.testing.assert_close(masked[[0, 2]], logits[[0, 2]], rtol=0, atol=0)
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and all(
        tokenizer.decode([t])
        and ("yes".startswith(tokenizer.decode([t])) or "no".startswith(tokenizer.decode([t])))
        for t in allowed
    )


def test_sampler_greedy_masked_argmax_and_neighbours(backend: GrammarBackend) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0, max_tokens=8)
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
    rows = [SamplingRow(params=greedy), SamplingRow(params=seeded)]
    plain = Sampler(seed=0)(logits[:2], rows).token_ids
    grammar = backend.state(SPEC)
    mixed_rows = [*rows, SamplingRow(params=greedy, grammar=grammar)]
    mixed = Sampler(seed=0)(logits[:3], mixed_rows).token_ids
    assert mixed[:2] == plain  # the constrained row changes nothing beside it
    first = mixed[2]
    allowed = apply_grammar_masks(logits[2:3], [0], [backend.state(SPEC)], [[]])
    assert first == int(allowed.argmax()) and backend.info.decoded_vocab[first] == b"{"


def test_greedy_grammar_rows_take_the_masked_argmax_op_with_the_full_paths_result(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    """A batch of greedy grammar rows goes through `ops.masked_argmax` + `token_logprobs`
    (no masked logits built): the same tokens, ranks and unsamplable rows as the full
    stage-1 path (no ops), logprobs to float32 summation order; a failed row included."""
    from metrale.kernels import KernelOps

    greedy = SamplingParams(temperature=0, max_tokens=8)
    prefix = tokenizer.encode('{"k": "', add_special_tokens=False)
    bad = tokenizer.encode("no json", add_special_tokens=False)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4)) * 3

    def rows() -> list[SamplingRow]:
        outputs = [[], prefix, bad]
        return [SamplingRow(greedy, out, grammar=backend.state(SPEC)) for out in outputs]

    fast_sampler = Sampler(seed=0, ops=KernelOps())
    fast = fast_sampler(logits, rows())
    full = Sampler(seed=0)(logits, rows())
    assert fast_sampler.stats.get("grammar_greedy_kernel") == 1
    assert fast.token_ids == full.token_ids and fast.ranks == full.ranks
    assert fast.unsamplable_rows == full.unsamplable_rows == [2]
    torch.testing.assert_close(
        torch.tensor(fast.logprobs), torch.tensor(full.logprobs), rtol=0, atol=1e-5
    )
    assert backend.info.decoded_vocab[fast.token_ids[0]] == b"{"


def test_sync_is_idempotent_and_replays_after_a_rollback(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode('{"k": "yes"}', add_special_tokens=False)
    other = tokenizer.encode('{"k": "no"}', add_special_tokens=False)
    shared = next(i for i, (a, b) in enumerate(zip(ids, other)) if a != b)
    state = backend.state(SPEC)
    state.sync(ids[:shared])
    state.sync(ids[:shared])  # recompute preemption: the same output again
    assert state.num_seen == shared and not state.failed and state.rollbacks == 0
    # A verify: the drafts after the output are tried, then the commit replaces them.
    state.sync(ids, committed=shared)
    assert state.live and state.num_seen == len(ids)
    state.sync(other)
    assert state.rollbacks == len(ids) - shared and state.live and state.num_seen == len(other)
    assert state.valid_prefix(other[:shared], other[shared:]) == len(other) - shared
    assert state.num_seen == shared
    # The JSON is complete after ids, so EOS (0) is allowed too, and nothing after it.
    assert state.valid_prefix(ids[:shared], [*ids[shared:], 0, 7]) == len(ids) - shared + 1
    state.sync([*ids, *sorted(tokenizer.eos_token_ids)[:1]])
    assert state.terminated and not state.failed
    bitmask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    state.fill(bitmask, 0)  # after the end only the stop token
    bits = [t for t in range(VOCAB) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert bits == sorted(backend.stop_token_ids)


def test_rejected_token_makes_only_that_row_unsamplable(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    state = backend.state(SPEC)
    output = tokenizer.encode("no json", add_special_tokens=False)
    state.sync(output)
    assert state.failed
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0, max_tokens=4)
    out = Sampler(seed=0)(
        logits, [SamplingRow(params=params), SamplingRow(params, output, grammar=state)]
    )
    assert out.unsamplable_rows == [1]
    assert out.token_ids[0] == int(logits[0].argmax())


@pytest.mark.parametrize(
    ("spec", "construct"),
    [
        (GrammarSpec.json_schema({"type": "strange"}, "response_format"), "strange"),
        (GrammarSpec.text("regex", "a(b", "guided_regex"), "parenthesis is not closed"),
        (GrammarSpec.text("grammar", 'root ::= "a" | b', "guided_grammar"), 'Rule "b"'),
        (GrammarSpec("structural_tag", '{"type": "structural_tag"}', "response_format"), ""),
    ],
)
def test_refusals_name_the_field_and_construct(
    backend: GrammarBackend, spec: GrammarSpec, construct: str
) -> None:
    with pytest.raises(InvalidRequestError, match="not supported") as info:
        backend.compile(spec)
    assert info.value.param == spec.param and construct in info.value.message
    assert "/project/" not in info.value.message  # xgrammar's C++ location is cut


def test_spec_validation() -> None:
    with pytest.raises(InvalidRequestError, match="choice needs"):
        GrammarSpec.choice([], "guided_choice")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        GrammarSpec.json_schema("{", "guided_json")
    with pytest.raises(InvalidRequestError, match="must be an object"):
        GrammarSpec.json_schema([1], "guided_json")
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # type: ignore[arg-type]


def test_special_tool_call_marker_is_one_allowed_token() -> None:
    """Mistral's `[TOOL_CALLS]` is a special token: the tool-call grammar allows that token
    (not only its spelling in plain-text pieces), and other special tokens stay out."""
    from metrale.server.tool_parsers import get_parser
    from metrale.server.tools import ToolChoice, normalize_tools

    tokenizer = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    tokenizer.backend.add_special_tokens(["[TOOL_CALLS]"])
    marker = tokenizer.token_to_id("[TOOL_CALLS]")
    assert marker == VOCAB
    backend = GrammarBackend(tokenizer, VOCAB + 1, tokenizer.eos_token_ids)
    tools = normalize_tools([{"type": "function", "function": {"name": "f"}}])
    state = backend.state(get_parser("mistral").grammar(tools, ToolChoice("required")))
    logits = torch.zeros(1, VOCAB + 1)
    allowed = torch.isfinite(apply_grammar_masks(logits, [0], [state], [[]])[0])
    assert allowed[marker]
    # Inside a free JSON string, the other special tokens are never allowed.
    free = backend.state(GrammarSpec.json_schema({"type": "string"}, "x"))
    inside = torch.isfinite(
        apply_grammar_masks(logits, [0], [free], [tokenizer.encode('"', add_special_tokens=False)])[
            0
        ]
    )
    assert (
        inside[tokenizer.token_to_id("Hello") or 70]
        and not inside[tokenizer.token_to_id("<|im_start|>")]
    )


def test_prefilled_rows_are_used_only_at_the_position_they_were_filled_at(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    """A row filled ahead (`advance_async`) replaces the fill at the same position; after the
    synced tokens change (an advance, or a rollback to a different list of the same length)
    it is stale and the row is filled afresh; the masks equal plain fills either way."""
    prefix = tokenizer.encode('{"k": "', add_special_tokens=False)
    other = tokenizer.encode('{"k":"', add_special_tokens=False)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))

    def plain(tokens: list[list[int]]) -> torch.Tensor:
        return apply_grammar_masks(logits, [0, 1], [backend.state(SPEC) for _ in tokens], tokens)

    states = [backend.state(SPEC), backend.state(SPEC)]
    for state in states:
        state.sync(prefix)
    backend.advance_async((), (), states).result()
    got = apply_grammar_masks(logits, [0, 1], states, [prefix, prefix])
    assert [s.prefill_hits for s in states] == [1, 1]
    torch.testing.assert_close(got, plain([prefix, prefix]), rtol=0, atol=0)
    backend.advance_async((), (), states).result()
    states[1].sync(other)  # a different list: its prefilled row is stale
    got = apply_grammar_masks(logits, [0, 1], states, [prefix, other])
    assert [s.prefill_hits for s in states] == [2, 1]
    torch.testing.assert_close(got, plain([prefix, other]), rtol=0, atol=0)


def test_chunked_advance_accepts_then_prefills_each_row_in_its_chunk(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    """`advance_async` over 30 rows (several chunks, `grammar_advance`): every matcher takes
    its token and its prefilled row is the plain fill after it; the sampler then copies the
    whole block (every row a prefill hit) and the mask equals plain fills; a failed row
    (a refused token) is failed after it as after `sync`."""
    from metrale.sampling.grammar_advance import MIN_CHUNK_ROWS

    rows = 30
    assert rows >= 3 * MIN_CHUNK_ROWS
    prefix = tokenizer.encode('{"k": "', add_special_tokens=False)
    yes = tokenizer.encode('{"k": "yes', add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(5))
    outputs = [[*prefix, yes[len(prefix)] if i % 7 else bad] for i in range(rows)]
    states = [backend.state(SPEC) for _ in range(rows)]
    for state in states:
        state.sync(prefix)
    backend.advance_async(states, outputs, states).result()
    assert [s.failed for s in states] == [i % 7 == 0 for i in range(rows)]
    got = apply_grammar_masks(logits, list(range(rows)), states, outputs)
    assert all(s.prefill_hits == 1 for s in states)
    fresh = [backend.state(SPEC) for _ in range(rows)]
    expected = apply_grammar_masks(logits, list(range(rows)), fresh, outputs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_sync_many_equals_syncing_each(
    backend: GrammarBackend, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit's batched advance (`sync_many`) leaves every state as `sync` would: one-token
    appends (accepted, rejected, after the end), longer jumps, rollbacks to a shorter output
    and a repeated output, side by side in one call, step after step."""
    from metrale.sampling.grammar import GrammarState, bitmask_words

    ids = tokenizer.encode('{"k": "yes"}', add_special_tokens=False)
    eos = sorted(tokenizer.eos_token_ids)[0]
    bad = tokenizer.encode("zzz", add_special_tokens=False)[0]
    # Each row's successive outputs (a commit at a time).
    walks = [
        [ids[:i] for i in range(1, len(ids) + 1)] + [[*ids, eos]],  # one token a step, then EOS
        [ids[:1], ids[:2], [*ids[:2], bad], [*ids[:2], bad, bad]],  # rejected, then past it
        [ids[:1], ids[:4], ids[:4], ids[:2], ids[:3]],  # a jump, a repeat, a rollback
        [ids[:1], [*ids[:1], bad], ids[:2]],  # rejected, then the output replaced
        [[*ids, eos], [*ids, eos, 5]],  # a token after the grammar's end
    ]
    one = [backend.state(SPEC) for _ in walks]
    many = [backend.state(SPEC) for _ in walks]
    batched: list[int] = []
    real = xgr.BatchGrammarMatcher.batch_accept_token

    def spy(matchers, tokens, debug_print=False):  # type: ignore[no-untyped-def]
        batched.append(len(matchers))
        return real(matchers, tokens, debug_print)

    monkeypatch.setattr(xgr.BatchGrammarMatcher, "batch_accept_token", staticmethod(spy))
    words = bitmask_words(VOCAB)
    for step in range(max(len(w) for w in walks)):
        rows = [j for j, w in enumerate(walks) if step < len(w)]
        for j in rows:
            one[j].sync(walks[j][step])
        GrammarState.sync_many([many[j] for j in rows], [walks[j][step] for j in rows])
        for j in rows:
            a, b = one[j], many[j]
            assert (a._view, a._accepted, a.failed, a.terminated, a.live) == (
                b._view,
                b._accepted,
                b.failed,
                b.terminated,
                b.live,
            ), (j, step)
            ma = torch.zeros(1, words, dtype=torch.int32)
            mb = torch.zeros(1, words, dtype=torch.int32)
            a.fill(ma, 0)
            b.fill(mb, 0)
            assert torch.equal(ma, mb), (j, step)
    assert sum(batched) >= len(ids) and max(batched) >= 3  # the batched path ran


def test_kept_termination_follows_accepts_and_rollbacks(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    """A state's termination (kept beside the matcher, so the step's checks make no xgrammar
    call) is the matcher's after a stop token's accept, after a rollback behind it, and after
    the batched accept (`sync_many`)."""
    done = tokenizer.encode('{"k": "yes"}', add_special_tokens=False)
    stop = min(tokenizer.eos_token_ids)
    state = backend.state(SPEC)
    state.sync(done)
    assert not state.terminated and state.live
    state.sync([*done, stop])
    assert state.terminated and state._matcher.is_terminated() and not state.live
    state.sync(done[:-1])  # rolled back behind the stop token and the closing brace
    assert not state.terminated and not state._matcher.is_terminated() and state.live
    other = backend.state(SPEC)
    other.sync(done)
    GrammarState.sync_many([state, other], [done, [*done, stop]])
    assert not state.terminated and state.live
    assert other.terminated and other._matcher.is_terminated()
