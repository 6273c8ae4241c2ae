"""The encoder-decoder's static decoder step (`EncDecStepGraphs`; on the CPU its body runs
eagerly, the body CUDA graphs capture on a GPU) against the eager step, float32 on the CPU:
the same requests give the same hypotheses with and without it (tokens identical, scores
within 1e-4), with a mixed batch of beam parameters and sources holding the pad token; a
source over the pool's width or a batch over the largest rung runs eagerly, counted, with
the same result; every source slot and block is free at the end."""

from __future__ import annotations

import random

import pytest

from metrale.model_engine.beam import BeamOutput, BeamParams, BeamRequest, BeamSearchDriver
from metrale.model_engine.encdec_model import EncoderDecoderModel, load_encoder_decoder
from tests.helpers import m2m100 as tiny

EOS = 2


def _requests(variant: tiny.EncDecVariant, count: int, seed: int) -> list[BeamRequest]:
    rng = random.Random(seed)
    reqs = []
    for i in range(count):
        body = [rng.randrange(6, 512) for _ in range(rng.randrange(1, 14))]
        if i % 5 == 4:
            body.insert(len(body) // 2, tiny.PAD_ID)
        src = [variant.lang_id(variant.languages[0]), *body, EOS]
        tgt = variant.lang_id(variant.languages[1 + i % (len(variant.languages) - 1)])
        params = BeamParams(
            num_beams=(4, 3, 4, 2)[i % 4], n=1 + i % 2, length_penalty=(0.6, 1.0, 2.0, -0.5)[i % 4],
            early_stopping=(True, False, "never")[i % 3], max_tokens=12,
            min_tokens=(0, 0, 3)[i % 3], no_repeat_ngram_size=(0, 2, 0, 3)[i % 4],
        )  # fmt: skip
        reqs.append(BeamRequest(f"r{i}", [EOS], params, source=src, forced=[tgt]))
    return reqs


def _run(model: EncoderDecoderModel, reqs: list[BeamRequest]) -> list[BeamOutput]:
    fresh = [BeamRequest(r.request_id, r.prompt, r.params, r.source, r.forced) for r in reqs]
    outs = BeamSearchDriver(model, [EOS]).run(fresh)
    assert model.block_pool.num_free == model.block_pool.num_usable
    return outs


def _assert_same(got: list[BeamOutput], want: list[BeamOutput]) -> None:
    for g, w in zip(got, want, strict=True):
        assert [h.token_ids for h in g.hypotheses] == [h.token_ids for h in w.hypotheses]
        for hg, hw in zip(g.hypotheses, w.hypotheses, strict=True):
            assert hg.score == pytest.approx(hw.score, abs=1e-4)


@pytest.mark.parametrize("variant", tiny.VARIANTS, ids=lambda v: v.name)
def test_static_step_matches_the_eager_step(variant: tiny.EncDecVariant) -> None:
    path = tiny.build(variant)
    reqs = _requests(variant, 16, seed=11)
    want = _run(load_encoder_decoder(path, num_blocks=400, block_size=4), reqs)
    model = load_encoder_decoder(path, num_blocks=400, block_size=4)
    graphs = model.enable_step_graphs(max_sources=16, source_cap=16)
    got = _run(model, reqs)
    _assert_same(got, want)
    assert graphs.replays > 0 and graphs.eager_forwards == 0
    assert graphs.captured_rungs == []  # the CPU runs the body, captures nothing
    assert len(graphs._free_slots) == 16  # every request gave its source slot back


def test_steps_that_do_not_fit_run_eagerly() -> None:
    variant = tiny.NLLB_STYLE
    path = tiny.build(variant)
    reqs = _requests(variant, 6, seed=3)
    want = _run(load_encoder_decoder(path, num_blocks=400, block_size=4), reqs)
    # Sources over 8 tokens get no slot; 2 slots for 6 requests; at most 8 rows a step.
    model = load_encoder_decoder(path, num_blocks=400, block_size=4)
    graphs = model.enable_step_graphs(max_rows=8, max_sources=2, source_cap=8)
    assert graphs.rungs == [1, 2, 4, 8]
    _assert_same(_run(model, reqs), want)
    assert graphs.eager_forwards > 0
    assert len(graphs._free_slots) == 2
    # One request at a time fits (4 beams, a short source): every step replays.
    short = [r for r in reqs if len(r.source or []) <= 8][:1]
    assert short
    before = graphs.eager_forwards
    _assert_same(
        _run(model, short), _run(load_encoder_decoder(path, num_blocks=400, block_size=4), short)
    )
    assert graphs.eager_forwards == before
