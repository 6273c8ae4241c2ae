"""Speculative decoding on hybrid (SSM) models: Nemotron-H and Bamba (Mamba-2) and Qwen3-Next
(gated delta net). Verify rows run token by token through the recurrent layers' decode step,
each verify row's checkpoint and inputs are stashed, and the commit restores the checkpoint
and replays the accepted tokens (`metrale/model_engine/ssm_verify.py`).

Shown here: greedy tokens are identical with speculation on and off on every hybrid variant
(full, partial and zero acceptance forced by `ScriptedProposer`, chunked prefill beside
verify rows, single-token decode rows after a verify row, preemption by recompute and by
swap, aborts) and every block, SSM slot and stash comes back; a rejected draft leaves the
recurrent state bit-identical; a replayed multi-turn conversation comes back byte-identical.
"""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.layers.recurrent_verify import RecurrentVerify
from metrale.model_engine.ssm_verify import SlotStash
from metrale.model_engine.traits import PrefillSlice, SequenceState
from metrale.model_engine.transformer_model import TransformerModel
from tests.helpers.checkpoints import HYBRID_VARIANTS, Variant, build
from tests.helpers.engine_checks import assert_no_leaks, run_aborting
from tests.helpers.spec import ScriptedProposer
from tests.spec.test_spec_engine import SPEC, assert_same, greedy, prompts

MAMBA = next(v for v in HYBRID_VARIANTS if v.name == "nemotronh-moe")
GDN = next(v for v in HYBRID_VARIANTS if v.name == "qwen3next")
#: Qwen3-Next with MLP blocks only: no MoE before a recurrent layer (see the state test).
QWEN3NEXT_MLP = Variant(
    "qwen3next-mlp",
    "qwen3_next",
    tuple({**dict(GDN.overrides), "mlp_only_layers": [0, 1, 2, 3]}.items()),
)
#: Variants where an MoE block feeds a recurrent layer.
MOE_BEFORE_RECURRENT = {"qwen3next", "qwen3next-classic"}


def spy_layouts(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record the row lengths of every forward's sequential (verify) rows."""
    seen: list[list[int]] = []
    original = RecurrentVerify.lay_out

    def lay_out(self: RecurrentVerify, starts, lengths, slots, device) -> None:  # type: ignore[no-untyped-def]
        seen.append(list(lengths))
        original(self, starts, lengths, slots, device)

    monkeypatch.setattr(RecurrentVerify, "lay_out", lay_out)
    return seen


# ------------------------------------------------------------------ engine: greedy identity


@pytest.mark.parametrize("variant", HYBRID_VARIANTS, ids=lambda v: v.name)
def test_greedy_identical_with_speculation_every_hybrid(
    variant: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    ps = prompts(6, seed=5)
    path = str(build(variant))
    kw: dict[str, object] = dict(max_num_seqs=4, max_prefill_chunk=8, max_num_batched_tokens=24)
    ref = LLM(path, device="cpu", **kw).generate(ps, greedy())
    # Two prompts' drafts stop early, so their rows decode without drafts beside verify rows.
    truth = {
        tuple(p): list(o.outputs[0].token_ids)[: 8 if i % 3 == 1 else None]
        for i, (p, o) in enumerate(zip(ps, ref))
    }
    proposer = ScriptedProposer(truth, wrong=0.3)
    layouts = spy_layouts(monkeypatch)
    on = LLM(path, device="cpu", speculative_config=SPEC, proposer=proposer, **kw)
    got = on.generate(ps, greedy())
    assert_same(ref, got)
    accepted = {a for _, a in proposer.verdicts}
    assert 0 in accepted and max(accepted) == 3 and accepted & {1, 2}
    assert on.engine.spec_stats.num_accepted_tokens == sum(a for _, a in proposer.verdicts)
    # Verify rows ran sequentially, some beside single-token rows after them.
    assert any(n > 1 for lens in layouts for n in lens)
    assert any(1 in lens[1:] for lens in layouts)
    assert_no_leaks(on.engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("variant", HYBRID_VARIANTS, ids=lambda v: v.name)
def test_preemption_with_speculation_every_hybrid(variant: object, mode: str) -> None:
    ps = prompts(8, seed=3, lo=4, hi=24)
    params = greedy(32, min_tokens=32)
    path = str(build(variant))
    ref = LLM(path, device="cpu", max_num_seqs=8, num_kv_blocks=200).generate(ps, params)
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    on = LLM(
        path,
        device="cpu",
        max_num_seqs=8,
        num_kv_blocks=12,
        preemption_mode=mode,
        speculative_config=SPEC,
        proposer=ScriptedProposer(truth),
    )
    got = on.generate(ps, params)
    assert_same(ref, got)
    stats = on.engine.scheduler.stats
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    assert on.engine.spec_stats.num_accepted_tokens > 0
    assert_no_leaks(on.engine)


@pytest.mark.parametrize("variant", HYBRID_VARIANTS, ids=lambda v: v.name)
def test_abort_mid_speculation_keeps_others_identical_every_hybrid(variant: object) -> None:
    ps = prompts(6, seed=40)
    path = str(build(variant))
    params = greedy(24)
    ref = LLM(path, device="cpu").generate(ps, params)
    truth = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(ps, ref)}
    llm = LLM(path, device="cpu", speculative_config=SPEC, proposer=ScriptedProposer(truth))
    engine = llm.engine
    finals = run_aborting(engine, ps, params, 4)
    for i in (0, 1, 3, 5):
        assert finals[f"r{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert engine.spec_stats.verify_steps > 0
    assert_no_leaks(engine)


# ------------------------------------------------------------------ model: the state itself


def slot_state(model: TransformerModel, seq: SequenceState) -> list[tuple[torch.Tensor, ...]]:
    slot = seq.ssm_slot_idx()
    assert slot is not None and model.ssm_pool is not None
    return [(conv[slot].clone(), ssm[slot].clone()) for conv, ssm in model.ssm_pool.layers]


def assert_equal_states(a: list, b: list) -> None:
    for (ca, sa), (cb, sb) in zip(a, b, strict=True):
        assert torch.equal(ca, cb) and torch.equal(sa, sb)


def max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def verify(model: TransformerModel, seq: SequenceState, tokens: list[int]) -> torch.Tensor:
    return model.mixed_verify_batch([tokens[0]], [tokens[1:]], [seq], []).decode_logits


def replay_by_hand(model: TransformerModel, stash: SlotStash, rows: int) -> list:
    """The stash's checkpoint, then its first `rows` stashed inputs through each layer's
    decode step, in a fresh slot: what a commit keeping `rows` tokens must leave."""
    scratch = model.alloc_sequence()
    slot = scratch.ssm_slot_idx()
    index = torch.tensor([slot])
    with torch.inference_mode():
        for layer in stash.capture.layers:
            conv_states, ssm_states = layer.state
            conv_states[slot].copy_(layer.conv)
            ssm_states[slot].copy_(layer.ssm)
            for j in range(rows):
                layer.mixer.recurrent_step(
                    tuple(i[j : j + 1] for i in layer.inputs), layer.state, index
                )
    state = slot_state(model, scratch)
    model.free_sequence(scratch)
    return state


@pytest.mark.parametrize("variant", [*HYBRID_VARIANTS, QWEN3NEXT_MLP], ids=lambda v: v.name)
def test_rejected_drafts_leave_the_state_bit_identical(variant: Variant) -> None:
    """From one starting state (sequences prefilled with the same prompt, whose states are
    equal): `[t, d1, X]` and `[t, d1, Y]` committing 1 leave equal conv and SSM tensors in
    every layer, each exactly its checkpoint plus a by-hand replay of `t, d1`; `[t, X, Y]`
    committing 0 leaves exactly the checkpoint plus a replay of `t`; all equal plain decodes
    of the same tokens to float32 rounding.

    Two limits, measured (max abs difference, conv / SSM tensors):
    - Plain decode is not bit-identical on the CPU: a one-row `F.linear` is not bit-identical
      to a row of a multi-row one (BLAS blocking). Verify vs plain decode: about 1e-7 / 1e-12
      (Mamba-2), 6e-8 / 1e-9 (gated delta net); asserted below 1e-5.
    - On the Qwen3-Next MoE variants an MoE block precedes a recurrent layer, and the
      reference MoE groups a forward's tokens by expert, so the rejected draft's routing
      changes the gemm shapes, hence the last bits, of the accepted rows' hidden states: the
      `X` and `Y` runs differ by about 6e-8 / 2e-10 there although each is exactly its own
      checkpoint plus replay. With MLP blocks instead (`qwen3next-mlp`) they are equal."""
    llm = LLM(str(build(variant)), device="cpu", num_kv_blocks=64, max_num_seqs=6)
    model = llm.engine.model
    assert isinstance(model, TransformerModel) and model.ssm_stash is not None
    prompt = prompts(1, seed=90, lo=20, hi=21)[0]
    seqs = [model.alloc_sequence() for _ in range(5)]
    for s in seqs:
        logits = model.prefill(prompt, s)
    t = int(logits.argmax())
    for s in seqs[1:]:
        assert_equal_states(slot_state(model, s), slot_state(model, seqs[0]))
    a, b, c, d, e = seqs
    d1 = int(model.decode_batch([t], [d])[0].argmax())  # d decodes t, d1 plainly
    model.decode_batch([d1], [d])
    model.decode_batch([t], [e])  # e decodes t plainly
    x, y = (d1 + 11) % 400 + 6, (d1 + 23) % 400 + 6

    verify(model, a, [t, d1, x])
    verify(model, b, [t, d1, y])
    stash_a, stash_b = model.ssm_stash.get(a.ssm_slot_idx()), model.ssm_stash.get(b.ssm_slot_idx())
    assert stash_a is not None and stash_b is not None and stash_a.capture.rows == 3
    assert max_diff(slot_state(model, a), slot_state(model, b)) > 0  # the drafts differ
    model.commit_accepted_prefix(a, 1, 2)
    model.commit_accepted_prefix(b, 1, 2)
    assert a.seq_len == b.seq_len == len(prompt) + 2
    assert model.ssm_pool.num_tokens[a.ssm_slot_idx()] == a.seq_len
    assert_equal_states(slot_state(model, a), replay_by_hand(model, stash_a, 2))
    assert_equal_states(slot_state(model, b), replay_by_hand(model, stash_b, 2))
    if variant.name in MOE_BEFORE_RECURRENT:
        assert max_diff(slot_state(model, a), slot_state(model, b)) < 1e-6
    else:
        assert_equal_states(slot_state(model, a), slot_state(model, b))

    verify(model, c, [t, x, y])
    stash_c = model.ssm_stash.get(c.ssm_slot_idx())
    assert stash_c is not None
    model.commit_accepted_prefix(c, 0, 2)
    assert model.ssm_stash.get(c.ssm_slot_idx()) is None and c.seq_len == len(prompt) + 1
    assert_equal_states(slot_state(model, c), replay_by_hand(model, stash_c, 1))

    # Plain decode of the same tokens: equal to rounding.
    assert max_diff(slot_state(model, a), slot_state(model, d)) < 1e-5
    assert max_diff(slot_state(model, c), slot_state(model, e)) < 1e-5
    # And the rolled-back sequences go on like the plain ones.
    assert torch.allclose(model.decode_batch([x], [a]), model.decode_batch([x], [d]), atol=1e-4)
    assert torch.allclose(model.decode_batch([y], [c]), model.decode_batch([y], [e]), atol=1e-4)
    for s in seqs:
        model.free_sequence(s)
    assert model.ssm_pool.num_free() == model.ssm_pool.num_slots and len(model.ssm_stash) == 0


@pytest.mark.parametrize("variant", [MAMBA, GDN], ids=lambda v: v.name)
def test_replay_reproduces_a_batched_sequential_verify_bit_for_bit(variant: object) -> None:
    """A forward with two verify rows, a single-token decode row between them and a prefill
    chunk beside: rolling each verify row back to all of its rows (`rollback_ssm_states`,
    one token per call) gives back the live state the batched verify left, bit for bit; the
    single-token row and the prefill chunk leave no stash."""
    llm = LLM(str(build(variant)), device="cpu", num_kv_blocks=64, max_num_seqs=6)
    model = llm.engine.model
    ps = prompts(4, seed=91, lo=10, hi=20)
    seqs = [model.alloc_sequence() for _ in range(4)]
    for p, s in zip(ps[:3], seqs[:3]):
        model.prefill(p, s)
    decode = seqs[:3]
    result = model.mixed_verify_batch(
        [7, 8, 9], [[10, 11, 12], [], [13, 14]], decode, [PrefillSlice(ps[3], seqs[3], 0, 6, False)]
    )
    assert result.decode_logits.shape[0] == 4 + 1 + 3
    assert len(model.ssm_stash) == 2
    live = [slot_state(model, s) for s in decode]
    model.rollback_ssm_states(decode[0], 3)
    model.rollback_ssm_states(decode[2], 2)
    assert_equal_states(slot_state(model, decode[0]), live[0])
    assert_equal_states(slot_state(model, decode[2]), live[2])
    assert len(model.ssm_stash) == 0
    for s in seqs:
        model.free_sequence(s)


def test_bare_checkpoint_and_a_commit_without_a_checkpoint() -> None:
    """`checkpoint_ssm_states` snapshots the live state and `rollback_ssm_states(seq, 0)`
    restores it; a commit that drops drafts with no stash of that verify raises instead of
    keeping the rejected drafts' state."""
    llm = LLM(str(build(GDN)), device="cpu", num_kv_blocks=64, max_num_seqs=2)
    model = llm.engine.model
    seq = model.alloc_sequence()
    model.prefill(prompts(1, seed=92)[0], seq)
    before = slot_state(model, seq)
    model.checkpoint_ssm_states(seq)
    model.decode_batch([5], [seq])
    assert max_diff(slot_state(model, seq), before) > 0
    model.rollback_ssm_states(seq, 0)
    assert_equal_states(slot_state(model, seq), before)
    seq.seq_len -= 1  # the caller rewinds the sequence
    del seq.tokens[-1]
    verify(model, seq, [5, 6, 7])
    model.ssm_stash.discard(seq)
    with pytest.raises(ValueError, match="no checkpoint of this 2-draft verify"):
        model.commit_accepted_prefix(seq, 0, 2)
    model.free_sequence(seq)


# ------------------------------------------------------------------ multi-turn replays


@pytest.mark.parametrize("variant", [MAMBA, GDN], ids=lambda v: v.name)
def test_multi_turn_conversation_replays_byte_identical(variant: Variant) -> None:
    """A 4-turn conversation (each turn's prompt: the previous prompt, its output and new
    tokens) replayed 12 times on one engine with speculation on gives byte-identical outputs
    every round, equal to a run without speculation. Each round corrupts a different share of
    the drafts (none to all), so the rounds roll back different draft positions."""
    path = str(build(variant))
    news = prompts(4, seed=93, lo=6, hi=12)
    params = SamplingParams(temperature=0, max_tokens=12)

    def conversation(llm: LLM) -> list[tuple[list[int], str]]:
        history: list[int] = []
        turns = []
        for new in news:
            prompt = history + new
            out = llm.generate([prompt], params)[0].outputs[0]
            turns.append((list(out.token_ids), out.text))
            history = prompt + list(out.token_ids)
        return turns

    reference = conversation(LLM(path, device="cpu"))
    truth: dict[tuple[int, ...], list[int]] = {}
    history = []
    for new, (tokens, _) in zip(news, reference):
        truth[tuple(history + new)] = tokens
        history = [*history, *new, *tokens]
    proposer = ScriptedProposer(truth)
    llm = LLM(path, device="cpu", speculative_config=SPEC, proposer=proposer)
    for r in range(12):
        proposer.wrong = (0.0, 0.3, 0.6, 1.0)[r % 4]
        assert conversation(llm) == reference, f"round {r + 1}"
    accepted = {a for _, a in proposer.verdicts}
    assert 0 in accepted and 3 in accepted and accepted & {1, 2}
    assert_no_leaks(llm.engine)
