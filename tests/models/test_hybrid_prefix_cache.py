"""Prefix caching on hybrid models through SSM snapshots: multi-turn chats on each hybrid
architecture hit from turn 2 on (`cached_tokens > 0`, counting only tokens whose KV and state
were both reused) and give exactly the cache-off tokens (float32 CPU; logprobs within 1e-5:
the recurrent scan splits at other points); the A.7 poisoning gate (12 replays of a branching
conversation set in random interleavings give the cold tokens, and every snapshot left holds
the state a cold prefill of its prefix leaves, so none drifted); no snapshot crosses a prefix
namespace; preemption (recompute and swap) and aborts release every snapshot exactly; with no
snapshot slots the cache is bypassed as before, with its warning; and a KV prefix without its
recurrent state is still refused, never used silently."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.engine.request import RequestOutput
from tests.helpers.checkpoints import HYBRID_VARIANTS, Variant, build
from tests.helpers.engine_checks import (
    assert_no_leaks,
    assert_snapshots_match_cold,
    run_aborting,
)

ARCHS = [v for v in HYBRID_VARIANTS if v.name in ("nemotronh-moe", "bamba", "qwen3next")]
NEMOTRON = ARCHS[0]
BLOCK = 16
PARAMS = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, logprobs=2)
LOGPROB_TOL = 1e-5


def make(variant: Variant, **kwargs: object) -> LLM:
    defaults: dict[str, object] = dict(device="cpu", num_kv_blocks=120, max_num_seqs=4)
    defaults.update(kwargs)
    return LLM(str(build(variant)), **defaults)  # type: ignore[arg-type]


def assert_same(got: RequestOutput, ref: RequestOutput) -> None:
    a, b = got.outputs[0], ref.outputs[0]
    assert a.token_ids == b.token_ids
    if a.logprobs is not None and b.logprobs is not None:
        for pos_a, pos_b in zip(a.logprobs, b.logprobs, strict=True):
            for tok, lp in pos_a.items():
                assert abs(lp.logprob - pos_b[tok].logprob) <= LOGPROB_TOL


def tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(6, 512, (n,), generator=g).tolist()


@pytest.mark.parametrize("variant", ARCHS, ids=lambda v: v.name)
def test_multi_turn_chat_hits_from_turn_two_and_matches_cache_off(variant: Variant) -> None:
    on, off = make(variant), make(variant, enable_prefix_caching=False)
    system = "You are a careful assistant. " * 6
    chat: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn, question in enumerate(["def add(a, b):", "import os", "class Foo:", "x = 1"]):
        chat.append({"role": "user", "content": question})
        got = on.chat(chat, PARAMS)[0]
        ref = off.chat(chat, PARAMS)[0]
        assert_same(got, ref)
        assert ref.num_cached_tokens == 0
        if turn == 0:
            assert got.num_cached_tokens == 0
        else:  # the previous turn's tail or decode snapshot, block-aligned, short of the end
            n = len(got.prompt_token_ids)
            assert 0 < got.num_cached_tokens < n and got.num_cached_tokens % BLOCK == 0
        chat.append({"role": "assistant", "content": got.outputs[0].text})
    stats = on.engine.model.prefix_cache_stats()
    assert stats["ssm_snapshot_hits"] == 3 and stats["ssm_snapshot_miss_cold"] == 1
    assert_snapshots_match_cold(on.engine.model, off.engine.model)
    assert stats["bypassed_lookups"] == 0
    assert on.engine.scheduler.stats.prefix_hit_tokens == stats["ssm_snapshot_hit_tokens"]
    assert_no_leaks(on.engine)


@pytest.mark.parametrize("variant", ARCHS, ids=lambda v: v.name)
def test_token_turns_hit_the_decode_track(variant: Variant) -> None:
    """Turn k + 1 = turn k's prompt and answer plus a message: it restores the state the
    previous turn's decode left at its last block boundary (inside the answer)."""
    on, off = make(variant), make(variant, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(3)
    params = PARAMS.replace(max_tokens=24, min_tokens=24)
    conv = tokens(g, 40)
    expected = 0
    for _ in range(3):
        got, ref = on.generate([conv], params)[0], off.generate([conv], params)[0]
        assert_same(got, ref)
        assert got.num_cached_tokens == expected
        answered = conv + got.outputs[0].token_ids
        # The last block boundary this turn's decode reached (its final token is not fed).
        expected = (len(answered) - 1) // BLOCK * BLOCK
        conv = answered + tokens(g, 7)
    assert_snapshots_match_cold(on.engine.model, off.engine.model)
    assert_no_leaks(on.engine)


def branching_conversations(g: torch.Generator) -> tuple[list[list[list[int]]], list[int]]:
    """Three conversations over one shared system prompt, diverging at their first message
    (two of them only mid-block), three user turns each; and the system prompt."""
    system = tokens(g, 45)
    firsts = [tokens(g, 9), tokens(g, 9), tokens(g, 20)]
    firsts[1][:4] = firsts[0][:4]  # a late divergence: inside the same block
    return [[first, tokens(g, 5), tokens(g, 12)] for first in firsts], system


def run_conversations(
    llm: LLM,
    system: list[int],
    convs: list[list[list[int]]],
    rng: random.Random | None,
    params: SamplingParams,
) -> dict[tuple[int, int], list[int]]:
    """Every conversation's turns in order; with `rng`, conversations interleave at random and
    groups of 1-3 next turns run together (in one batch)."""
    history = {c: list(system) for c in range(len(convs))}
    next_turn = dict.fromkeys(range(len(convs)), 0)
    out: dict[tuple[int, int], list[int]] = {}
    while any(t < len(convs[c]) for c, t in next_turn.items()):
        live = [c for c, t in next_turn.items() if t < len(convs[c])]
        if rng is None:
            group = live[:1]
        else:
            rng.shuffle(live)
            group = live[: rng.randint(1, 3)]
        prompts = [history[c] + convs[c][next_turn[c]] for c in group]
        for c, prompt, res in zip(group, prompts, llm.generate(prompts, params), strict=True):
            answer = res.outputs[0].token_ids
            out[(c, next_turn[c])] = answer
            history[c] = prompt + answer
            next_turn[c] += 1
    return out


@pytest.mark.parametrize("variant", [ARCHS[0], ARCHS[2]], ids=lambda v: v.name)
def test_poisoning_gate_twelve_random_replays_equal_cold_runs(variant: Variant) -> None:
    g = torch.Generator().manual_seed(11)
    convs, system = branching_conversations(g)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    off = make(variant, enable_prefix_caching=False)
    cold = run_conversations(off, system, convs, None, params)
    on = make(variant)
    rng = random.Random(2026)
    for _ in range(12):
        assert run_conversations(on, system, convs, rng, params) == cold
    stats = on.engine.model.prefix_cache_stats()
    assert stats["ssm_snapshot_hits"] > 12 * 6
    assert_snapshots_match_cold(on.engine.model, off.engine.model)  # no state drifted
    assert_no_leaks(on.engine)


def test_snapshots_never_cross_prefix_namespaces() -> None:
    llm = make(NEMOTRON)
    engine = llm.engine
    prompt = tokens(torch.Generator().manual_seed(4), 50)
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)

    def run(request_id: str, namespace: str | None) -> RequestOutput:
        engine.add_request(
            request_id, None, params, prompt_token_ids=prompt, cache_namespace=namespace
        )
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final = out
        assert final is not None
        return final

    first = run("a1", "tenant-a")
    other = run("b1", "tenant-b")
    again = run("a2", "tenant-a")
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens == 48  # the tail split of a 50-token prompt
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == again.outputs[0].token_ids
    stats = engine.model.prefix_cache_stats()
    assert stats["ssm_snapshot_miss_wrong_adapter"] == 1 and stats["ssm_snapshot_hits"] == 1
    assert_no_leaks(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_aborts_release_snapshots_exactly(mode: str) -> None:
    g = torch.Generator().manual_seed(9)
    system = tokens(g, 33)
    prompts = [system + tokens(g, 3 + 4 * i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    ref = make(NEMOTRON, enable_prefix_caching=False, num_kv_blocks=200, max_num_seqs=6)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    tight = make(NEMOTRON, num_kv_blocks=22, max_num_seqs=6, preemption_mode=mode)
    assert tight.generate(prompts[:1], params)[0].outputs[0].token_ids == want[0]
    got = tight.generate(prompts, params)  # the system prompt's snapshot is there now
    assert [o.outputs[0].token_ids for o in got] == want
    stats = tight.engine.scheduler.stats
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    assert tight.engine.model.prefix_cache_stats()["ssm_snapshot_hits"] > 0
    assert_no_leaks(tight.engine)
    # Aborts mid-decode (decode tracks held) and mid-prefill release theirs too.
    finals = run_aborting(tight.engine, prompts, params, abort_at_step=6, aborted=(2, 4))
    for i in (0, 1, 3, 5):
        assert finals[f"r{i}"].outputs[0].token_ids == want[i]
    assert_no_leaks(tight.engine)


def test_no_snapshot_slots_bypasses_the_cache_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = torch.Generator().manual_seed(5)
    system = tokens(g, 40)
    prompts = [system, system + tokens(g, 3), system]
    with caplog.at_level(logging.WARNING, logger="metrale.model_engine.transformer_model"):
        bypass = make(NEMOTRON, ssm_snapshot_slots=0)
    assert any("prefix caching is bypassed" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="metrale.model_engine.transformer_model"):
        on = make(NEMOTRON)
    assert not any("bypassed" in r.getMessage() for r in caplog.records)
    got = [bypass.generate([p], PARAMS)[0] for p in prompts]
    hit = [on.generate([p], PARAMS)[0] for p in prompts]
    for a, b in zip(got, hit, strict=True):
        assert_same(a, b)
    assert all(o.num_cached_tokens == 0 for o in got)
    assert [o.num_cached_tokens for o in hit] == [0, 32, 32]
    assert bypass.engine.model.prefix_cache_stats()["bypassed_lookups"] == len(prompts)


def test_a_kv_prefix_without_its_recurrent_state_is_refused() -> None:
    llm = make(NEMOTRON, num_kv_blocks=32, max_num_seqs=2)
    model = llm.engine.model
    prompt = tokens(torch.Generator().manual_seed(5), 43)
    seq = model.alloc_sequence()
    # What a prefix hit without an SSM snapshot would hand over: KV for 16 tokens, no state.
    seq.block_table = model.block_pool.allocate(1)
    seq.tokens, seq.seq_len = list(prompt[:16]), 16
    with pytest.raises(ValueError, match="recurrent state"):
        model.prefill_chunk(prompt, seq, 16, len(prompt) - 16, True)
    model.free_sequence(seq)
    assert model.num_free_slots() == 2 and model.num_free_blocks() == model.num_total_blocks()


def slot_state(model: object, seq: object) -> list[torch.Tensor]:
    pool = model.ssm_pool  # type: ignore[attr-defined]
    slot = seq.ssm_slot_idx()  # type: ignore[attr-defined]
    return [t[slot].clone() for pair in pool.layers for t in pair]


@pytest.mark.parametrize("variant", ARCHS, ids=lambda v: v.name)
def test_a_restored_snapshot_continues_as_a_cold_prefill(variant: Variant) -> None:
    """Split invariance (A.7 #2): two-phase prefill snapshots the tail split; a longer prompt
    restores it bit for bit (the state a cold prefill of those tokens leaves) and prefills the
    rest, after which its recurrent state and logits equal one cold prefill of the whole."""
    model = make(variant).engine.model
    g = torch.Generator().manual_seed(21)
    first = tokens(g, 70)
    longer = first + tokens(g, 12)
    a = model.alloc_sequence()
    assert model.lookup_prefix(a, first) == 0 and model.prefill_capture_point(a) == 64
    model.prefill_twophase(first, a, chunk_size=1000)
    model.free_sequence(a)
    at_split = model.alloc_sequence()
    model.prefill_chunk(first, at_split, 0, 64, False)
    warm = model.alloc_sequence()
    assert model.lookup_prefix(warm, longer) == 64 and warm.marconi_skip_to == 64
    restored = slot_state(model, warm)
    assert max(t.abs().max().item() for t in restored) > 1e-2  # a state worth restoring
    for w, c in zip(restored, slot_state(model, at_split), strict=True):
        assert torch.equal(w, c)
    model.free_sequence(at_split)
    cold = model.alloc_sequence()
    warm_logits = model.prefill(longer, warm)
    cold_logits = model.prefill(longer, cold)
    torch.testing.assert_close(warm_logits, cold_logits, atol=1e-5, rtol=0)
    for w, c in zip(slot_state(model, warm), slot_state(model, cold), strict=True):
        torch.testing.assert_close(w, c, atol=1e-5, rtol=0)
    model.free_sequence(warm)
    model.free_sequence(cold)
    model.snapshots.check()
    assert model.snapshots.num_private() == 0 and model.snapshots.num_published() == 1


def test_snapshot_metrics_are_exported() -> None:
    """The `/metrics` families of the snapshot store carry the model's counters."""
    from metrale.server.metric_families import snapshot_metrics as _snapshot_metrics

    llm = make(NEMOTRON, ssm_snapshot_slots=3)
    g = torch.Generator().manual_seed(8)
    conv = tokens(g, 40)
    for _ in range(3):
        out = llm.generate([conv], PARAMS)[0]
        conv = conv + out.outputs[0].token_ids + tokens(g, 5)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in _snapshot_metrics(llm.engine.model.prefix_cache_stats())
        for s in family.samples
    }
    assert samples[("metrale_ssm_snapshot_slots_total", ())] == 3
    assert 0 < samples[("metrale_ssm_snapshot_slots_used", ())] <= 3
    assert samples[("metrale_ssm_snapshot_hits_total", ())] == 2
    assert samples[("metrale_ssm_snapshot_misses_total", (("cause", "cold"),))] == 1
    per_slot = samples[("metrale_ssm_snapshot_bytes_per_slot", ())]
    assert (
        samples[("metrale_ssm_snapshot_bytes_used", ())]
        == per_slot * (samples[("metrale_ssm_snapshot_slots_used", ())])
    )
    assert llm.engine.model.ssm_snapshot_occupancy() == (
        samples[("metrale_ssm_snapshot_slots_used", ())],
        3,
    )


@pytest.mark.parametrize("variant", [ARCHS[0], ARCHS[2]], ids=lambda v: v.name)
def test_turns_hit_with_speculative_decoding_on(variant: Variant) -> None:
    """A.7 #8: with ngram speculation (verify rows roll the state back; a committed verify
    that ends on a block boundary refreshes the decode track) the turns still hit and give the
    cache-off, speculation-off tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    on, off = make(variant, speculative_config=spec), make(variant, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(12)
    motif = tokens(g, 6)
    conv = tokens(g, 20) + motif * 5  # repeats, so the ngram proposer drafts
    params = SamplingParams(temperature=0, max_tokens=30, min_tokens=30)
    for turn in range(3):
        got, ref = on.generate([conv], params)[0], off.generate([conv], params)[0]
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        assert (got.num_cached_tokens > 0) == (turn > 0)
        conv = conv + got.outputs[0].token_ids + motif * 2
    assert on.engine.spec_stats.num_draft_tokens > 0
    assert_snapshots_match_cold(on.engine.model, off.engine.model)
    assert_no_leaks(on.engine)


def test_capture_points_tail_branch_and_the_two_block_filter() -> None:
    """A cold prompt snapshots its tail split; a sibling whose KV match outruns the snapshots
    also snapshots that branch point (Marconi), and a third prompt then restores it; a point
    within two blocks of the restored snapshot is skipped (it would cost a split, save little)."""
    model = make(NEMOTRON).engine.model
    g = torch.Generator().manual_seed(30)
    a = tokens(g, 100)
    b = a[:40] + tokens(g, 60)
    seq = model.alloc_sequence()
    assert model.lookup_prefix(seq, a) == 0
    assert (seq.tail_checkpoint_tokens, seq.ssm_branch_tokens) == (96, None)
    model.prefill_twophase(a, seq, chunk_size=1000)
    model.free_sequence(seq)
    seq = model.alloc_sequence()
    assert model.lookup_prefix(seq, b) == 0  # KV for 32 tokens, no state there
    assert (seq.ssm_branch_tokens, seq.tail_checkpoint_tokens) == (32, 96)
    assert model.prefill_capture_point(seq) == 32
    model.prefill_twophase(b, seq, chunk_size=1000)
    model.free_sequence(seq)
    seq = model.alloc_sequence()
    assert model.lookup_prefix(seq, a[:40] + tokens(g, 50)) == 32  # the branch snapshot
    assert seq.tail_checkpoint_tokens == 80 and seq.ssm_branch_tokens is None
    model.free_sequence(seq)
    seq = model.alloc_sequence()
    assert model.lookup_prefix(seq, a[:40] + tokens(g, 30)) == 32
    assert seq.tail_checkpoint_tokens is None  # 64: two blocks above the restored 32
    model.free_sequence(seq)
    seq = model.alloc_sequence()
    assert model.lookup_prefix(seq, a + tokens(g, 10)) == 96
    assert model.prefill_capture_point(seq) is None  # tail 96 + 0..1 block: skipped
    model.free_sequence(seq)
    stats = model.prefix_cache_stats()
    assert stats["ssm_snapshot_miss_no_snapshot"] == 1 and stats["ssm_snapshot_hits"] == 3
    model.snapshots.check()


def test_min_gap_skips_a_tail_capture_near_the_restored_snapshot_and_outputs_stay() -> None:
    """`ssm_snapshot_min_gap_tokens`: with a wide gap a warm prompt whose tail lies a few
    blocks past the restored snapshot runs its rest in one forward (no tail split), and still
    gives the tokens of a cold run."""
    g = torch.Generator().manual_seed(31)
    prefix = tokens(g, 96)
    prompt = prefix + tokens(g, 60)
    params = SamplingParams(temperature=0, max_tokens=8)
    wide = make(NEMOTRON, ssm_snapshot_min_gap_tokens=128)
    narrow = make(NEMOTRON)
    cold = make(NEMOTRON, enable_prefix_caching=False).generate([prompt], params)[0]
    for llm, tail in ((wide, None), (narrow, 144)):
        llm.generate([prefix], SamplingParams(temperature=0, max_tokens=1))
        model = llm.engine.model
        seq = model.alloc_sequence()
        assert model.lookup_prefix(seq, prompt) == 80  # the first prompt's tail snapshot
        assert seq.tail_checkpoint_tokens == tail
        model.free_sequence(seq)
        assert_same(llm.generate([prompt], params)[0], cold)
        assert_no_leaks(llm.engine)
