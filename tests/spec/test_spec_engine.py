"""Speculative decoding in the engine, by invariance: the same requests give the same greedy
tokens with speculation on and off, for every dense and MoE architecture, across chunked
prefill, prefix-cache hits, preemption (both modes), aborts, stop strings, `max_tokens` and
`n > 1`; sampled outputs keep their distribution (a chi-square test that fails when
rejection sampling is replaced by greedy acceptance); every block comes back.

The drafts come from `ScriptedProposer`, which knows each prompt's true greedy continuation
(from a run without speculation) and corrupts some draft positions on purpose, so verify
rows see full acceptance, partial acceptance and none at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.spec.proposer import DraftRequest
from tests.helpers.checkpoints import DENSE_VARIANTS, MOE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks, run_aborting
from tests.helpers.spec import ScriptedProposer

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "gate": "off"}
LLAMA = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")


def prompts(count: int, seed: int = 5, lo: int = 4, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(6, 500, (int(n),), generator=g).tolist()
        for n in torch.randint(lo, hi, (count,), generator=g)
    ]


def greedy(max_tokens: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, **kw)  # type: ignore[arg-type]


def run_pair(
    variant_path: str,
    ps: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    wrong: float = 0.3,
    **kw: object,
) -> tuple[list, list, LLM, ScriptedProposer]:
    off = LLM(variant_path, device="cpu", **kw)
    ref = off.generate(ps, params)
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    proposer = ScriptedProposer(truth, wrong)
    on = LLM(variant_path, device="cpu", speculative_config=SPEC, proposer=proposer, **kw)
    got = on.generate(ps, params)
    return ref, got, on, proposer


def assert_same(ref: list, got: list) -> None:
    for a, b in zip(ref, got, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert cb.token_ids == ca.token_ids
            assert cb.text == ca.text
            assert cb.finish_reason == ca.finish_reason
            assert cb.stop_reason == ca.stop_reason
            if ca.logprobs is not None:
                assert cb.logprobs is not None
                for pa, pb in zip(ca.logprobs, cb.logprobs, strict=True):
                    assert pa.keys() == pb.keys()
                    for t in pa:
                        assert math.isclose(pa[t].logprob, pb[t].logprob, abs_tol=1e-4)
                        assert pa[t].rank == pb[t].rank


@pytest.mark.parametrize("variant", DENSE_VARIANTS + MOE_VARIANTS, ids=lambda v: v.name)
def test_greedy_identical_with_speculation_every_architecture(variant: object) -> None:
    ps = prompts(6)
    ref, got, on, proposer = run_pair(
        str(build(variant)), ps, greedy(), max_num_seqs=4, max_prefill_chunk=16
    )
    assert_same(ref, got)
    stats = on.engine.spec_stats
    assert stats.verify_steps > 0 and stats.num_drafts > 0
    # Full, partial and zero acceptance all happened.
    accepted = {a for d, a in proposer.verdicts}
    assert 0 in accepted and max(accepted) == 3 and accepted & {1, 2}
    assert stats.num_accepted_tokens == sum(a for _, a in proposer.verdicts)
    assert_no_leaks(on.engine)


def test_prefix_cache_hits_and_chunked_prefill() -> None:
    shared = prompts(1, seed=9, lo=40, hi=41)[0]
    ps = [shared + p for p in prompts(5, seed=10, lo=3, hi=12)]
    path = str(build(LLAMA))
    ref, got, on, _ = run_pair(path, ps, greedy(), max_num_seqs=8, max_prefill_chunk=16)
    assert_same(ref, got)
    again = on.generate(ps, greedy())  # every prompt now hits the cache
    assert all(o.num_cached_tokens >= 32 for o in again)
    assert_same(ref, again)
    assert_no_leaks(on.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_speculation(mode: str) -> None:
    ps = prompts(16, seed=3)
    params = greedy(48, min_tokens=48)
    path = str(build(LLAMA))
    ref = LLM(path, device="cpu", max_num_seqs=16, num_kv_blocks=400).generate(ps, params)
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    on = LLM(
        path,
        device="cpu",
        max_num_seqs=16,
        num_kv_blocks=16,
        preemption_mode=mode,
        speculative_config=SPEC,
        proposer=ScriptedProposer(truth),
    )
    got = on.generate(ps, params)
    assert_same(ref, got)
    stats = on.engine.scheduler.stats
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    assert on.engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(on.engine)


def test_stop_strings_stop_tokens_and_max_tokens() -> None:
    ps = prompts(8, seed=21)
    path = str(build(LLAMA))
    ref = LLM(path, device="cpu").generate(ps, greedy(30))
    # Stop on tokens and text that the greedy outputs really produce, mid-way.
    stop_ids = [ref[0].outputs[0].token_ids[5], ref[1].outputs[0].token_ids[9]]
    texts = [o.outputs[0].text for o in ref[2:5]]
    stops = [t[len(t) // 3 : len(t) // 3 + 3] for t in texts if len(t) > 6]
    params = [
        greedy(30, stop_token_ids=stop_ids, stop=stops),
        greedy(7),
        greedy(1),
        greedy(30, stop=stops, include_stop_str_in_output=True),
    ]
    for p in params:
        ref_p, got, on, _ = run_pair(path, ps, p, wrong=0.2)
        assert_same(ref_p, got)
        for out in got:
            assert len(out.outputs[0].token_ids) <= (p.max_tokens or 0)
        assert_no_leaks(on.engine)


def test_n_greater_than_one_and_seeded_rows_beside_greedy() -> None:
    ps = prompts(3, seed=30)
    path = str(build(LLAMA))
    params = [greedy(20).replace(n=3), greedy(20), greedy(20).replace(n=2)]
    ref, got, on, _ = run_pair(path, ps, params)
    assert_same(ref, got)
    # A seeded sampled request is reproducible with speculation on (with itself).
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=20, n=2)
    a = on.generate(ps, sampled)
    b = on.generate(ps, sampled)
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    assert_no_leaks(on.engine)


def test_abort_mid_speculation_keeps_others_identical() -> None:
    ps = prompts(6, seed=40)
    path = str(build(LLAMA))
    params = greedy(30)
    ref = LLM(path, device="cpu").generate(ps, params)
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    llm = LLM(path, device="cpu", speculative_config=SPEC, proposer=ScriptedProposer(truth))
    engine = llm.engine
    finals = run_aborting(engine, ps, params, 3)
    for i in (0, 1, 3, 5):
        assert finals[f"r{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert_no_leaks(engine)


def test_opt_out_request_never_speculates() -> None:
    ps = prompts(2, seed=50)
    path = str(build(LLAMA))
    ref = LLM(path, device="cpu").generate(ps, greedy(20))
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    proposer = ScriptedProposer(truth, wrong=0.0)
    llm = LLM(path, device="cpu", speculative_config=SPEC, proposer=proposer)
    engine = llm.engine
    engine.add_request("a", None, greedy(20), prompt_token_ids=ps[0], speculative=False)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert done["a"].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert proposer.calls == 0 and engine.spec_stats.num_drafts == 0
    # A row that cannot speculate keeps async scheduling's fed steps.
    assert engine.fed_steps > 0


def test_speculating_steps_drain_the_async_pipeline_and_count_it() -> None:
    ps = prompts(2, seed=51)
    path = str(build(LLAMA))
    ref = LLM(path, device="cpu").generate(ps, greedy(20))
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    llm = LLM(path, device="cpu", speculative_config=SPEC, proposer=ScriptedProposer(truth))
    assert_same(ref, llm.generate(ps, greedy(20)))
    engine = llm.engine
    assert engine.spec_stats.drained_for_spec > 0
    assert engine.drained_steps >= engine.spec_stats.drained_for_spec


# ------------------------------------------------------------------ distribution


def first_tokens(llm: LLM, prompt: list[int], seeds: range, params: SamplingParams) -> list:
    outs = llm.generate([prompt] * len(seeds), [params.replace(seed=s) for s in seeds])
    return [tuple(o.outputs[0].token_ids) for o in outs]


def chi_square_homogeneity(a: list, b: list) -> tuple[float, int]:
    """Two-sample chi-square statistic over categories (rare ones pooled) and its dof."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c]))
    bins: list[tuple[int, int]] = []
    pool = (0, 0)
    for c in cats:
        if ca[c] + cb[c] >= 20:
            bins.append((ca[c], cb[c]))
        else:
            pool = (pool[0] + ca[c], pool[1] + cb[c])
    if sum(pool) > 0:
        bins.append(pool)
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in bins:
        total = x + y
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(bins) - 1


def chi_square_p_value(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def test_sampled_first_four_tokens_keep_their_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(build(LLAMA))
    prompt = prompts(1, seed=60)[0]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4)
    off = LLM(path, device="cpu", max_num_seqs=256)
    # The drafts are the greedy continuation: a likely, but not certain, guess.
    greedy_out = off.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    truth = {tuple(prompt): list(greedy_out[0].outputs[0].token_ids)}
    on = LLM(
        path,
        device="cpu",
        max_num_seqs=256,
        speculative_config=SPEC,
        proposer=ScriptedProposer(truth, wrong=0.0),
    )
    n = 1500
    base = first_tokens(off, prompt, range(n), params)
    spec = first_tokens(on, prompt, range(10_000, 10_000 + n), params)
    assert on.engine.spec_stats.num_accepted_tokens > 0
    for j in range(1, 5):  # each prefix length: the joint of the first j tokens
        stat, dof = chi_square_homogeneity([t[:j] for t in base], [t[:j] for t in spec])
        assert chi_square_p_value(stat, dof) > 1e-3, (j, stat, dof)

    # The test can fail: accepting a draft exactly when it is the argmax ("greedy
    # acceptance") distorts the distribution, and the same statistic rejects it.
    import metrale.sampling.verify as verify

    def greedy_acceptance(probs: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor):
        return probs.argmax(dim=-1) == draft_ids

    monkeypatch.setattr(verify, "accept_drafts", greedy_acceptance)
    wrong = first_tokens(on, prompt, range(20_000, 20_000 + n), params)
    worst = min(
        chi_square_p_value(*chi_square_homogeneity([t[:j] for t in base], [t[:j] for t in wrong]))
        for j in range(1, 5)
    )
    assert worst < 1e-6


# ------------------------------------------------------------------ tenant isolation


def test_suffix_lookup_never_proposes_another_tenants_tokens() -> None:
    path = str(build(LLAMA))
    llm = LLM(
        path,
        device="cpu",
        speculative_config={"method": "suffix", "num_speculative_tokens": 4, "gate": "off"},
    )
    engine = llm.engine
    proposer = engine.speculation.proposer
    assert proposer is not None and proposer.name == "suffix"
    proposed: dict[str, list[int]] = {}
    original = proposer.propose

    def spy(requests: Sequence[DraftRequest]) -> list[list[int]]:
        out = original(requests)
        for r, d in zip(requests, out):
            proposed.setdefault(r.seq_id, []).extend(d)
        return out

    proposer.propose = spy  # type: ignore[method-assign]

    def run(rid: str, prompt: list[int], tenant: str) -> list[int]:
        engine.add_request(rid, None, greedy(24), prompt_token_ids=prompt, lookup_tenant=tenant)
        result: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    result = list(out.outputs[0].token_ids)
        return result

    # Tenant A's secret: tokens only A ever sends, after a context any tenant may send.
    context = [40, 41, 42, 43, 44]
    secret = list(range(300, 340))
    out_a = run("a1", context + secret, "A")
    # The same tenant gets A's continuation proposed from the shared index...
    run("a2", [7, 8, *context, *secret[:3]], "A")
    assert set(proposed.get("a2", [])) & set(secret[3:] + out_a)
    # ...another tenant, sending the same context and the secret's first tokens, is only
    # ever proposed tokens that appeared in its own tenant's sequences.
    b_tokens: set[int] = set()
    for i in range(3):
        prompt_b = [9, 10 + i, *context, *secret[:3]]
        b_tokens |= set(prompt_b)
        b_tokens |= set(run(f"b{i}", prompt_b, "B"))
        assert set(proposed.get(f"b{i}", [])) <= b_tokens
    leaked = {t for sid, ts in proposed.items() if sid.startswith("b") for t in ts}
    assert not leaked & (set(secret[3:]) - b_tokens), "tenant B was proposed tenant A's tokens"
    # A request outside every tenant (None) neither reads nor feeds the shared index.
    prompt_n = [7, 8, *context, *secret[:3]]
    own = set(prompt_n) | set(run("n0", prompt_n, None))  # type: ignore[arg-type]
    assert set(proposed.get("n0", [])) <= own


def test_startup_log_names_the_proposer_and_k(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="metrale"):
        LLM(
            str(build(LLAMA)),
            device="cpu",
            speculative_config='{"method": "ngram", "num_speculative_tokens": 5}',
        )
    assert any("speculative decoding: ngram k=5" in r.getMessage() for r in caplog.records)


def test_model_that_cannot_verify_runs_without_speculation_and_says_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hybrids verify (tests/spec/test_hybrid_spec.py); a model whose `can_batch_verify` is
    false still runs, with speculation off and the reason logged."""
    import logging

    from metrale.model_engine.transformer_model import TransformerModel

    path = str(build(LLAMA))
    ps = prompts(2, seed=70)
    ref = LLM(path, device="cpu").generate(ps, greedy(12))
    monkeypatch.setattr(TransformerModel, "can_batch_verify", lambda self, ks: False)
    with caplog.at_level(logging.WARNING):
        llm = LLM(path, device="cpu", speculative_config=SPEC)
    assert llm.engine.speculation.proposer is None and llm.engine.speculation.disabled
    assert any("speculative decoding is off" in r.getMessage() for r in caplog.records)
    assert_same(ref, llm.generate(ps, greedy(12)))


def test_bad_speculative_config_is_refused_at_startup_naming_the_key() -> None:
    from metrale.errors import InvalidRequestError

    path = str(build(LLAMA))
    with pytest.raises(InvalidRequestError) as err:
        LLM(path, device="cpu", speculative_config={"method": "ngram", "num_speculative_tokenz": 3})
    assert "num_speculative_tokenz" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:
        LLM(path, device="cpu", speculative_config={"method": "eagle", "num_speculative_tokens": 3})
    assert "method" in str(err.value)


def test_verify_through_the_graph_runner_body_matches() -> None:
    """The CUDA-graph verify path (every row padded to Q = k + 1 token rows, the decode
    attention's Q-row form) gives the same tokens; on the CPU the runner runs the graph's body
    uncaptured, so its staging, padding and logits selection are what is checked here."""
    from metrale.model_engine.cuda_graphs import DecodeGraphRunner

    ps = prompts(5, seed=80)
    path = str(build(LLAMA))
    ref = LLM(path, device="cpu").generate(ps, greedy(24))
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    llm = LLM(path, device="cpu", speculative_config=SPEC, proposer=ScriptedProposer(truth))
    model = llm.engine.model
    model.graph_runner = DecodeGraphRunner(
        model.module, model.kv_cache.layers, model.device, 8,
        -(-model.max_model_len // model.block_size), model.block_size, (1, 4),
    )  # fmt: skip
    runner = model.graph_runner
    calls: list[tuple[int, int]] = []
    run_verify = runner.run_verify

    def counted(tokens, starts, tables):  # type: ignore[no-untyped-def]
        calls.append(tokens.shape)
        return run_verify(tokens, starts, tables)

    runner.run_verify = counted  # type: ignore[method-assign]
    got = llm.generate(ps, greedy(24))
    assert_same(ref, got)
    assert calls and all(q == 4 for _, q in calls)  # every verify step took the Q=4 body
    assert runner.replays == 0  # uncaptured: the bodies ran eagerly
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(llm.engine)


class WrongProposer(ScriptedProposer):
    """Drafts that are never the model's choice: every row loses by speculating."""

    def __init__(self) -> None:
        super().__init__({}, wrong=1.0)

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.calls += 1
        return [[(r.tokens[-1] * 7 + j) % 500 + 6 for j in range(r.max_drafts)] for r in requests]


def test_the_gate_turns_off_rows_whose_drafts_never_pay() -> None:
    ps = prompts(3, seed=90)
    path = str(build(LLAMA))
    ref = LLM(path, device="cpu").generate(ps, greedy(60))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "gate": "auto",
            "gate_probe_tokens": 1000}  # fmt: skip
    llm = LLM(path, device="cpu", speculative_config=spec, proposer=WrongProposer())
    assert_same(ref, llm.generate(ps, greedy(60)))
    engine = llm.engine
    gate = engine.speculation.gate
    assert gate is not None and gate.counters["row_off"] == len(ps)
    # Each row stopped after the gate's minimum of verdicts, not after 60 tokens of them.
    assert engine.spec_stats.num_drafts <= len(ps) * gate.min_verifies
    assert engine.spec_stats.num_accepted_tokens == 0
    assert_no_leaks(engine)


def test_token_view_reads_prompt_then_output_in_place() -> None:
    from metrale.scheduler.sequence import TokenView

    prompt, output = [1, 2, 3], [4]
    view = TokenView(prompt, output)
    output.append(5)  # it follows the output as it grows
    assert len(view) == 5 and list(view) == [1, 2, 3, 4, 5]
    assert view[-1] == 5 and view[3] == 4 and view[1:4] == [2, 3, 4]
    with pytest.raises(IndexError):
        view[5]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_admission_never_takes_the_blocks_of_planned_drafts(mode: str) -> None:
    """A tight pool where sequences end early (no `min_tokens`): admissions that reclaim
    prefix-cache blocks must leave the planned drafts' blocks alone, or the verify forward
    finds the pool exhausted and its rows end with "error" (a bug once)."""
    ps = prompts(16, seed=3)
    path = str(build(LLAMA))
    ref = LLM(path, device="cpu", max_num_seqs=16, num_kv_blocks=400).generate(ps, greedy(48))
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    on = LLM(
        path,
        device="cpu",
        max_num_seqs=16,
        num_kv_blocks=16,
        preemption_mode=mode,
        speculative_config=SPEC,
        proposer=ScriptedProposer(truth, wrong=0.0),
    )
    got = on.generate(ps, greedy(48))
    assert all(o.outputs[0].finish_reason != "error" for o in got)
    assert_same(ref, got)
    assert_no_leaks(on.engine)
