"""Speculative method "mtp": the checkpoint's MTP head drafts.

- The bundled model's head, run by the engine (pending hidden rows, paged head KV, recursion
  for k > 1), gives the drafts of its reference implementation (`tools/tiny_model.py`).
- Greedy tokens are identical with MTP speculation on and off (bundled model, a tiny Qwen3
  and a tiny Qwen3-Next with an MTP head) across chunked prefill, preemption in both modes
  and aborts, and every block comes back.
- Sampled outputs keep their distribution (the chi-square test of part 1, with MTP drafts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig
from metrale.errors import InvalidRequestError
from metrale.model_engine.factory import load_model
from metrale.model_engine.mtp import pending_rows
from metrale.model_engine.traits import PrefillSlice
from tests.helpers.checkpoints import DENSE_VARIANTS, HYBRID_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks, run_aborting
from tests.helpers.mtp import with_mtp_head
from tests.spec.test_spec_engine import (
    assert_same,
    chi_square_homogeneity,
    chi_square_p_value,
    first_tokens,
    greedy,
    prompts,
)

ROOT = Path(__file__).resolve().parents[2]
BUNDLED = str(ROOT / "metrale" / "assets" / "tiny-code")
QWEN3 = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
QWEN3_NEXT = next(v for v in HYBRID_VARIANTS if v.name == "qwen3next")


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "gate": "off"}


@pytest.fixture(scope="module")
def qwen3_mtp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(with_mtp_head(QWEN3, tmp_path_factory.mktemp("qwen3-mtp"), source_layer=1))


@pytest.fixture(scope="module")
def qwen3_next_mtp(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Layer 3 of the variant is its full-attention layer (with a sparse MoE).
    return str(with_mtp_head(QWEN3_NEXT, tmp_path_factory.mktemp("qwen3next-mtp"), 3))


# ------------------------------------------------------------------ the head itself


def _reference_chain(ref: torch.nn.Module, ids: list[int], drafts: list[int]) -> list[int]:
    """The reference head's argmax chain: position n-1 pairs h_{n-1} with token n, and each
    further position pairs the head's own pre-norm output with the previous draft."""
    from tiny_model import rope_cos_sin  # type: ignore[import-not-found]

    x = torch.tensor([ids])
    n = len(ids) - 1  # the main model saw ids[:n]; ids[n] is the newest token
    with torch.no_grad():
        positions = torch.arange(n)
        h = ref.forward_hidden(x[:, :n], positions)  # pre-norm hidden rows
        hidden, nxt = h[0], list(ids[1 : n + 1])
        out: list[int] = []
        for _ in range(len(drafts)):
            pos = torch.arange(hidden.shape[0])
            e = ref.model.embed_tokens(torch.tensor([nxt]))
            z = torch.cat(
                (ref.mtp.pre_fc_norm_embedding(e), ref.mtp.pre_fc_norm_hidden(hidden[None])), -1
            )
            z = ref.mtp.fc(z)
            cos, sin = rope_cos_sin(ref.cfg, pos, z.dtype)
            for layer in ref.mtp.layers:
                z = layer(z, cos, sin)
            token = int(ref.lm_head(ref.mtp.norm(z))[0, -1].argmax())
            out.append(token)
            hidden = torch.cat([hidden, z[0, -1:]])
            nxt.append(token)
    return out


def test_bundled_head_drafts_equal_its_reference_implementation() -> None:
    tools = str(ROOT / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    from tiny_model import load_checkpoint  # type: ignore[import-not-found]

    ref = load_checkpoint(BUNDLED, dtype=torch.float32)
    config = EngineConfig(
        model=BUNDLED, device="cpu", dtype="float32", speculative_config=mtp(3), num_kv_blocks=64
    )
    model, _ = load_model(config, BUNDLED)
    g = torch.Generator().manual_seed(3)
    for n in (5, 17, 40):
        ids = torch.randint(10, 8000, (n + 1,), generator=g).tolist()
        seq = model.alloc_sequence()
        model.prefill_chunk(ids[:n], seq, 0, n, True)
        pending = pending_rows(seq)  # the prompt's rows went to the head at prefill: one left
        assert pending is not None and pending.start == n - 1 and pending.end == n
        got = model.mtp_propose([seq], [ids[n]], [3])[0]
        assert got == _reference_chain(ref, ids, got), n
        assert pending_rows(seq).end == n  # consumed: the next rows start at seq_len
        model.free_sequence(seq)
    assert model.block_pool.num_free == model.block_pool.num_blocks - 1


def test_mtp_on_a_checkpoint_without_a_head_is_refused_at_startup() -> None:
    path = str(build(next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")))
    with pytest.raises(InvalidRequestError, match="MTP layers"):
        LLM(path, device="cpu", speculative_config=mtp(2))


# ------------------------------------------------------------------ invariance


def test_bundled_model_greedy_identical_and_accepting() -> None:
    ps = prompts(6, seed=8, lo=8, hi=60)
    params = greedy(40)
    ref = LLM(BUNDLED, device="cpu", max_prefill_chunk=16).generate(ps, params)
    on = LLM(BUNDLED, device="cpu", max_prefill_chunk=16, speculative_config=mtp(3))
    assert_same(ref, on.generate(ps, params))
    stats = on.engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.2
    assert_no_leaks(on.engine)


def test_prefix_cache_hits_keep_tokens_and_drafts() -> None:
    """A second round of the same prompts hits the prefix cache: the head has no hidden rows
    for the cached positions (their head KV came with the cached blocks), and the tokens stay
    those of plain decoding."""
    ps = prompts(4, seed=9, lo=40, hi=70)
    params = greedy(24)
    ref = LLM(BUNDLED, device="cpu").generate(ps, params)
    on = LLM(BUNDLED, device="cpu", speculative_config=mtp(3))
    assert_same(ref, on.generate(ps, params))
    before = on.engine.spec_stats.num_accepted_tokens
    assert_same(ref, on.generate(ps, params))
    assert on.engine.scheduler.stats.prefix_hit_tokens > 0
    assert on.engine.spec_stats.num_accepted_tokens > before
    assert_no_leaks(on.engine)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_tiny_heads_greedy_identical_chunked(arch: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("qwen3_mtp" if arch == "qwen3" else "qwen3_next_mtp")
    ps = prompts(6, seed=11)
    params = greedy(24)
    ref = LLM(path, device="cpu", max_num_seqs=4, max_prefill_chunk=16).generate(ps, params)
    on = LLM(path, device="cpu", max_num_seqs=4, max_prefill_chunk=16, speculative_config=mtp(2))
    assert_same(ref, on.generate(ps, params))
    assert on.engine.spec_stats.num_draft_tokens > 0
    assert_no_leaks(on.engine)


@pytest.mark.parametrize("arch", ["bundled", "qwen3", "qwen3_next"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_mtp_through_preemption(mode: str, arch: str, request: pytest.FixtureRequest) -> None:
    paths = {"bundled": lambda: BUNDLED, "qwen3": lambda: request.getfixturevalue("qwen3_mtp"),
             "qwen3_next": lambda: request.getfixturevalue("qwen3_next_mtp")}  # fmt: skip
    qwen3_mtp = paths[arch]()
    ps = prompts(12, seed=3)
    params = greedy(40, min_tokens=40)
    ref = LLM(qwen3_mtp, device="cpu", max_num_seqs=12, num_kv_blocks=400).generate(ps, params)
    on = LLM(
        qwen3_mtp, device="cpu", max_num_seqs=12, num_kv_blocks=16, preemption_mode=mode,
        speculative_config=mtp(3),
    )  # fmt: skip
    assert_same(ref, on.generate(ps, params))
    stats = on.engine.scheduler.stats
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    assert on.engine.spec_stats.num_draft_tokens > 0
    assert_no_leaks(on.engine)


@pytest.mark.parametrize("arch", ["bundled", "qwen3_next"])
def test_mtp_abort_mid_speculation_keeps_others_identical(
    arch: str, request: pytest.FixtureRequest
) -> None:
    path = BUNDLED if arch == "bundled" else request.getfixturevalue("qwen3_next_mtp")
    ps = prompts(6, seed=40, lo=8, hi=40)
    params = greedy(30)
    ref = LLM(path, device="cpu").generate(ps, params)
    engine = LLM(path, device="cpu", speculative_config=mtp(3)).engine
    finals = run_aborting(engine, ps, params, 4)
    for i in (0, 1, 3, 5):
        assert finals[f"r{i}"].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert engine.spec_stats.num_draft_tokens > 0
    assert_no_leaks(engine)


def test_prefill_rows_without_hidden_leave_a_hole_not_an_error() -> None:
    """A forward that keeps no rows for the head (here: rows dropped by hand, as a prefix hit
    would) restarts the pending rows; drafting goes on from the next rows."""
    config = EngineConfig(
        model=BUNDLED, device="cpu", dtype="float32", speculative_config=mtp(2), num_kv_blocks=64
    )
    model, _ = load_model(config, BUNDLED)
    seq = model.alloc_sequence()
    ids = list(range(100, 140))
    model.prefill_batch_chunk([PrefillSlice(ids, seq, 0, 20, False)])
    seq.proposer_state = None  # as if the first 20 rows came from the prefix cache
    model.prefill_batch_chunk([PrefillSlice(ids, seq, 20, 19, True)])
    pending = pending_rows(seq)
    assert pending is not None and (pending.start, pending.end) == (38, 39)
    assert len(model.mtp_propose([seq], [ids[39]], [2])[0]) == 2
    model.free_sequence(seq)


# ------------------------------------------------------------------ distribution


def test_sampled_first_four_tokens_keep_their_distribution_with_mtp() -> None:
    prompt = prompts(1, seed=60, lo=12, hi=13)[0]
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4)
    off = LLM(BUNDLED, device="cpu", max_num_seqs=256)
    on = LLM(BUNDLED, device="cpu", max_num_seqs=256, speculative_config=mtp(3))
    n = 800
    base = first_tokens(off, prompt, range(n), params)
    spec = first_tokens(on, prompt, range(10_000, 10_000 + n), params)
    assert on.engine.spec_stats.num_accepted_tokens > 0
    for j in range(1, 5):
        stat, dof = chi_square_homogeneity([t[:j] for t in base], [t[:j] for t in spec])
        assert chi_square_p_value(stat, dof) > 1e-3, (j, stat, dof)


def test_propose_graph_body_gives_the_eager_drafts() -> None:
    """`MtpGraphRunner` (its body run uncaptured, as on the CPU) drafts what the eager
    propose drafts, from the states a decode step and a partly rejected verify leave."""
    from metrale.model_engine.mtp_graphs import MtpGraphRunner

    config = EngineConfig(
        model=BUNDLED, device="cpu", dtype="float32", speculative_config=mtp(3), num_kv_blocks=64
    )
    model, _ = load_model(config, BUNDLED)
    runner = MtpGraphRunner(
        model.module, model.head_kv_layers, model.device, model.dtype, 4, 16,
        model.block_size, 3,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(10, 8000, (60,), generator=g).tolist()
    seqs = [model.alloc_sequence() for _ in range(2)]  # [graphed, eager]
    for seq in seqs:
        model.prefill_chunk(ids[:30], seq, 0, 30, True)
        assert len(model.mtp_propose([seq], [ids[30]], [3])[0]) == 3  # eager: 30 rows
        model.decode_batch([ids[30]], [seq])  # one pending row
    checks = 0
    for step in range(3):
        newest = ids[31 + 3 * step]
        model.mtp_graphs = {3: runner}
        graphed = model.mtp_propose([seqs[0]], [newest], [3])[0]
        model.mtp_graphs = {}
        eager = model.mtp_propose([seqs[1]], [newest], [3])[0]
        assert graphed == eager, step
        checks += 1
        # A verify of [newest, x, y] keeping one draft: two pending rows for the next one.
        for seq in seqs:
            model.mixed_verify_batch([newest], [[ids[32 + 3 * step], 7]], [seq], [])
            model.commit_accepted_prefix(seq, 1, 2)
    assert checks == 3 and runner.replays == 3
    for seq in seqs:
        model.free_sequence(seq)


def test_seed_entry_points_run_the_same_head() -> None:
    config = EngineConfig(
        model=BUNDLED, device="cpu", dtype="float32", speculative_config=mtp(3), num_kv_blocks=64
    )
    model, _ = load_model(config, BUNDLED)
    ids = list(range(200, 240))
    a, b, c = (model.alloc_sequence() for _ in range(3))
    for seq in (a, b, c):
        model.prefill_chunk(ids[:30], seq, 0, 30, True)
    chain = model.mtp_propose([a], [ids[30]], [3])[0]
    assert model.run_mtp_propose_multi(ids[30], 30, 3, b) == chain
    assert model.run_mtp_propose(ids[30], 30, c) == chain[0]
    assert model.run_mtp_propose(ids[30], 30, c) is None  # its rows are consumed
    # Nothing pending now: a catch-up consumes nothing; after a decode step, one row.
    assert model.run_mtp_catchup_batched([ids[30]], 0, [30], [b]) == 0
    model.decode_batch([ids[30]], [b])
    assert model.run_mtp_catchup_batched([ids[31]], 0, [31], [b]) == 1
    with pytest.raises(ValueError, match="grammar"):
        model.run_mtp_propose_multi(ids[31], 31, 2, b, grammar_bitmask=object())
    for seq in (a, b, c):
        model.free_sequence(seq)
