"""Speculative decoding with a draft checkpoint (`method: draft_model`), by invariance: greedy
outputs are the same with speculation on and off across chunked prefill, prefix-cache hits,
preemption (both modes) and aborts; sampled outputs keep their distribution; a draft that IS
the target has every draft accepted (so the draft's catch-up and rollback bookkeeping is
exact); no block leaks in the target and the draft pool is entirely free at the end; a draft
with another vocabulary is refused at start-up.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from metrale import LLM, SamplingParams
from metrale.engine.draft_proposer import DraftModelProposer
from metrale.errors import CheckpointError
from metrale.spec.proposer import DraftRequest
from tests.helpers.checkpoints import DENSE_VARIANTS, DRAFT_VARIANTS, build, truncated
from tests.helpers.engine_checks import assert_no_leaks, run_aborting
from tests.spec.test_spec_engine import (
    assert_same,
    chi_square_homogeneity,
    chi_square_p_value,
    first_tokens,
    greedy,
    prompts,
)

LLAMA = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
QWEN3_SMALL = next(v for v in DRAFT_VARIANTS if v.name == "qwen3-draft-small")
VOCAB256 = next(v for v in DRAFT_VARIANTS if v.name == "llama-draft-vocab256")


def spec(draft: Path | str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k,
            "gate": "off"}  # fmt: skip


def proposer_of(llm: LLM) -> DraftModelProposer:
    proposer = llm.engine.speculation.proposer
    assert isinstance(proposer, DraftModelProposer)
    return proposer


def assert_all_free(llm: LLM) -> None:
    """No leak in the target; the draft holds no state and every draft block is free."""
    assert_no_leaks(llm.engine)
    proposer = proposer_of(llm)
    assert proposer.stats()["sequences"] == 0
    draft = proposer.draft
    draft.block_pool.check()
    assert draft.num_free_blocks() == draft.num_total_blocks()


def acceptance(llm: LLM) -> float:
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0
    return stats.num_accepted_tokens / stats.num_draft_tokens


def test_draft_that_is_the_target_has_every_draft_accepted() -> None:
    path = build(LLAMA)
    ps = prompts(6)
    kw = dict(device="cpu", max_num_seqs=4, max_prefill_chunk=16)
    ref = LLM(str(path), **kw).generate(ps, greedy())
    on = LLM(str(path), speculative_config=spec(path, k=4), **kw)
    assert_same(ref, on.generate(ps, greedy()))
    assert acceptance(on) == 1.0
    assert on.engine.spec_stats.verify_steps > 0
    assert_all_free(on)


@pytest.mark.parametrize("draft", ["layer-skip", "qwen3-small"])
def test_greedy_identical_with_a_different_draft(draft: str) -> None:
    path = str(build(LLAMA))
    draft_dir = truncated(LLAMA, 1) if draft == "layer-skip" else build(QWEN3_SMALL)
    ps = prompts(6, seed=7)
    kw = dict(device="cpu", max_num_seqs=4, max_prefill_chunk=16)
    ref = LLM(path, **kw).generate(ps, greedy())
    on = LLM(path, speculative_config=spec(draft_dir), **kw)
    assert_same(ref, on.generate(ps, greedy()))
    stats = on.engine.spec_stats
    assert stats.verify_steps > 0 and stats.num_drafts > 0
    if draft == "layer-skip":  # the first layer alone often agrees: full, partial and none
        assert 0.05 < acceptance(on) < 0.95
        assert stats.accepted_per_pos[2] > 0
    assert_all_free(on)


def test_prefix_cache_hits_and_chunked_prefill() -> None:
    shared = prompts(1, seed=9, lo=40, hi=41)[0]
    ps = [shared + p for p in prompts(5, seed=10, lo=3, hi=12)]
    path = build(LLAMA)
    kw = dict(device="cpu", max_num_seqs=8, max_prefill_chunk=16)
    ref = LLM(str(path), **kw).generate(ps, greedy())
    on = LLM(str(path), speculative_config=spec(truncated(LLAMA, 1)), **kw)
    assert_same(ref, on.generate(ps, greedy()))
    again = on.generate(ps, greedy())  # every prompt now hits the target's prefix cache
    assert all(o.num_cached_tokens >= 32 for o in again)
    assert_same(ref, again)
    assert on.engine.spec_stats.num_accepted_tokens > 0
    assert_all_free(on)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_draft_model(mode: str) -> None:
    ps = prompts(16, seed=3)
    # No min_tokens: the draft does not see the target's EOS masking, so under min_tokens a
    # draft that is the target proposes the EOS the target then refuses (acceptance < 1).
    params = greedy(48)
    path = build(LLAMA)
    ref = LLM(str(path), device="cpu", max_num_seqs=16, num_kv_blocks=400).generate(ps, params)
    on = LLM(
        str(path),
        device="cpu",
        max_num_seqs=16,
        num_kv_blocks=16,
        preemption_mode=mode,
        speculative_config=spec(path),  # the target as draft: every miss is bookkeeping
    )
    assert_same(ref, on.generate(ps, params))
    stats = on.engine.scheduler.stats
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    assert acceptance(on) == 1.0
    counters = proposer_of(on).stats()
    # The draft pool (as many blocks as the target's) ran short and gave up rows, not tokens.
    assert counters["draft_pool_misses"] + counters["draft_evictions"] > 0
    assert_all_free(on)


def test_abort_mid_speculation_keeps_others_identical() -> None:
    ps = prompts(6, seed=40)
    path = build(LLAMA)
    params = greedy(30)
    ref = LLM(str(path), device="cpu").generate(ps, params)
    llm = LLM(str(path), device="cpu", speculative_config=spec(truncated(LLAMA, 1)))
    engine = llm.engine
    finals = run_aborting(engine, ps, params, 3)
    for i in (0, 1, 3, 5):
        assert finals[f"r{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert engine.spec_stats.num_drafts > 0
    assert_all_free(llm)


def test_rollback_gives_the_drafts_of_a_fresh_draft_state() -> None:
    """After drafting past the committed tokens, a propose for committed tokens that took
    other turns drafts exactly what a proposer that never saw the old drafts drafts."""
    path = build(LLAMA)
    llm = LLM(str(path), device="cpu", speculative_config=spec(truncated(LLAMA, 1), k=4))
    proposer = proposer_of(llm)
    fresh = DraftModelProposer(proposer.draft, 4)
    base = prompts(1, seed=11, lo=20, hi=21)[0]
    first = proposer.propose([DraftRequest("s", base, len(base), 4)])[0]
    assert len(first) == 4
    # Accept two drafts then a token of the target's own: the draft holds 1 rejected draft.
    for tokens in (base + first[:2] + [7], base + first[:2] + [7, 8, 9, 10], [*base[:5], 3]):
        got = proposer.propose([DraftRequest("s", tokens, len(base), 4)])[0]
        want = fresh.propose([DraftRequest("f", tokens, len(base), 4)])[0]
        fresh.on_finished("f", tokens, None)
        assert got == want
    proposer.on_finished("s", [], None)
    assert proposer.draft.num_free_blocks() == proposer.draft.num_total_blocks()


def test_a_short_draft_pool_frees_idle_states_then_skips_rows() -> None:
    path = build(LLAMA)
    llm = LLM(str(path), device="cpu", num_kv_blocks=6, speculative_config=spec(path, k=2))
    proposer = proposer_of(llm)  # 5 usable draft blocks of 16 tokens
    a, b = prompts(2, seed=12, lo=40, hi=41)
    assert proposer.propose([DraftRequest("a", a, 40, 2)])[0]  # 41 tokens: 3 blocks
    # "b" needs 3 more blocks: "a" is not in this step, so its state goes first.
    assert proposer.propose([DraftRequest("b", b, 40, 2)])[0]
    assert proposer.stats()["draft_evictions"] == 1
    # Both in one step do not fit: the one that fits drafts, the other gets none.
    drafts = proposer.propose([DraftRequest("b", b, 40, 2), DraftRequest("a", a, 40, 2)])
    assert drafts[0] and drafts[1] == []
    assert proposer.stats()["draft_pool_misses"] == 1
    for seq_id in ("a", "b"):
        proposer.on_finished(seq_id, [], None)
    assert proposer.draft.num_free_blocks() == proposer.draft.num_total_blocks()


def test_sampled_tokens_keep_their_distribution() -> None:
    path = build(LLAMA)
    prompt = prompts(1, seed=60)[0]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3)
    off = LLM(str(path), device="cpu", max_num_seqs=256)
    on = LLM(
        str(path), device="cpu", max_num_seqs=256, speculative_config=spec(truncated(LLAMA, 1))
    )
    n = 1000
    base = first_tokens(off, prompt, range(n), params)
    got = first_tokens(on, prompt, range(10_000, 10_000 + n), params)
    assert on.engine.spec_stats.num_accepted_tokens > 0
    for j in range(1, 4):  # the joint of the first j tokens
        stat, dof = chi_square_homogeneity([t[:j] for t in base], [t[:j] for t in got])
        assert chi_square_p_value(stat, dof) > 1e-3, (j, stat, dof)
    assert_all_free(on)


def test_the_kv_budget_pays_for_the_draft_pool() -> None:
    """The target's pool shrinks so that it and the draft's (as many blocks) fit the budget."""
    from metrale.cache.kv_cache import PagedKVCache

    def per_block(model) -> int:  # type: ignore[no-untyped-def]
        c = model.config
        return PagedKVCache.bytes_per_block(
            model.module.kv_layer_count, model.block_size, c.num_key_value_heads, c.head_dim,
            model.dtype,
        )  # fmt: skip

    path, draft_dir = build(LLAMA), truncated(LLAMA, 1)
    kw = dict(device="cpu", max_model_len=128, max_num_seqs=64, cpu_kv_cache_gb=0.001)
    alone = LLM(str(path), **kw).engine.model
    on = LLM(str(path), speculative_config=spec(draft_dir), **kw)
    target, draft = on.engine.model, proposer_of(on).draft
    budget = int(0.001 * 2**30)
    both = per_block(target) + per_block(draft)
    assert draft.kv_cache.num_blocks == target.kv_cache.num_blocks
    assert target.kv_cache.num_blocks == budget // both < alone.kv_cache.num_blocks
    assert alone.kv_cache.num_blocks == budget // per_block(alone)


# ------------------------------------------------------------------ refusals


def test_a_draft_with_another_vocab_size_is_refused_naming_both() -> None:
    target, draft = str(build(LLAMA)), str(build(VOCAB256))
    with pytest.raises(CheckpointError) as err:  # the JSON text form, as the CLI passes it
        LLM(target, device="cpu", speculative_config=json.dumps(spec(draft)))
    msg = str(err.value)
    assert draft in msg and target in msg and "256" in msg and "512" in msg
    assert "vocab" in msg


def test_a_draft_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    target = str(build(LLAMA))
    draft = tmp_path / "draft"
    shutil.copytree(truncated(LLAMA, 1), draft)
    tok_path = draft / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # swap two tokens' ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    tok_path.write_text(json.dumps(tok))
    with pytest.raises(CheckpointError) as err:
        LLM(target, device="cpu", speculative_config=spec(draft))
    msg = str(err.value)
    assert "tokenizer" in msg and str(draft) in msg and target in msg


def test_a_hybrid_draft_is_refused() -> None:
    from tests.helpers.checkpoints import HYBRID_VARIANTS

    hybrid = next(v for v in HYBRID_VARIANTS if v.name == "nemotronh-classic")
    with pytest.raises(CheckpointError) as err:
        LLM(str(build(LLAMA)), device="cpu", speculative_config=spec(build(hybrid)))
    assert "recurrent" in str(err.value)


def test_the_draft_model_runs_the_kernel_warm_up_cleanly() -> None:
    """On CUDA the factory compiles the draft's kernels at load with `warm_forward_shapes`;
    here the same warm-up runs on the CPU draft: its forwards work and every block returns."""
    from metrale.model_engine.gpu_setup import warm_forward_shapes

    llm = LLM(str(build(LLAMA)), device="cpu", speculative_config=spec(truncated(LLAMA, 1)))
    proposer = llm.engine.speculation.proposer
    assert isinstance(proposer, DraftModelProposer)
    draft = proposer.draft
    free = draft.num_free_blocks()
    assert warm_forward_shapes(draft, 4) >= 0
    assert draft.num_free_blocks() == free
