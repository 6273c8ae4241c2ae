"""Property-based test of beam search's block accounting: over random traffic of translation
requests (beam widths 1-4, lengths, early stopping kinds) with steps and aborts, every block's
reference count equals the number of live beam sequences whose table holds it, the driver
ends holding no block, and every request that was not aborted produces exactly the
hypotheses it produces alone (sharing and copy-on-write change nothing)."""

from __future__ import annotations

import functools
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.errors import KVCacheExhausted
from metrale.model_engine.beam import BeamOutput, BeamParams, BeamRequest, BeamSearchDriver
from metrale.model_engine.encdec_model import EncoderDecoderModel, load_encoder_decoder
from tests.helpers import m2m100 as tiny

VARIANT = tiny.NLLB_STYLE
EOS = 2


@functools.cache
def _model() -> EncoderDecoderModel:
    # Block size 2: beams fork mid-block often, so copy-on-write runs.
    return load_encoder_decoder(tiny.build(VARIANT), num_blocks=600, block_size=2)


def _request(rid: str, kind: int, length: int, beams: int) -> BeamRequest:
    src = [
        VARIANT.lang_id("eng_Latn"),
        *[(7 * kind + 13 * i) % 500 + 6 for i in range(length)],
        EOS,
    ]
    params = BeamParams(
        num_beams=beams,
        n=min(2, beams),
        length_penalty=(1.0, 0.6, 2.0)[kind % 3],
        early_stopping=(True, False, "never")[kind % 3],
        max_tokens=3 + kind % 7,
        no_repeat_ngram_size=kind % 3,
    )
    return BeamRequest(rid, [EOS], params, source=src, forced=[VARIANT.lang_id("fra_Latn")])


@functools.cache
def _alone(kind: int, length: int, beams: int) -> list[tuple[list[int], float]]:
    out = BeamSearchDriver(_model(), [EOS]).run([_request("alone", kind, length, beams)])[0]
    return [(h.token_ids, h.score) for h in out.hypotheses]


def _check_refs(driver: BeamSearchDriver, model: EncoderDecoderModel) -> None:
    pool = model.block_pool
    pool.check()
    holders: Counter[int] = Counter()
    for seq in driver.live_sequences():
        holders.update(seq.block_table)
    for block in range(1, pool.num_blocks):
        assert pool.ref_count(block) == holders[block], f"block {block}"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 8), st.integers(1, 10), st.integers(1, 4)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0)),
    ),
    min_size=3,
    max_size=30,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_beam_traffic_frees_every_block(program: list[tuple[str, int, int, int]]) -> None:
    model = _model()
    driver = BeamSearchDriver(model, [EOS])
    specs: dict[str, tuple[int, int, int]] = {}
    aborted: set[str] = set()
    done: dict[str, BeamOutput] = {}
    for op, a, b, c in program:
        if op == "add":
            rid = f"r{len(specs)}"
            specs[rid] = (a, b, c)
            driver.add_request(_request(rid, a, b, c))
        elif op == "step":
            for _ in range(a):
                for out in driver.step():
                    done[out.request_id] = out
        else:
            live = [r for r in specs if r not in done and r not in aborted]
            if live:
                rid = live[a % len(live)]
                assert driver.abort_request(rid)
                aborted.add(rid)
        _check_refs(driver, model)
    while driver.has_unfinished():
        for out in driver.step():
            done[out.request_id] = out
        _check_refs(driver, model)
    assert model.block_pool.num_free == model.block_pool.num_usable
    assert set(done) == set(specs) - aborted
    for rid, out in done.items():
        got = [(h.token_ids, h.score) for h in out.hypotheses]
        assert [t for t, _ in got] == [t for t, _ in _alone(*specs[rid])], rid


def test_exhausted_pool_raises_and_frees_every_block() -> None:
    model = load_encoder_decoder(tiny.build(VARIANT), num_blocks=10, block_size=2)
    driver = BeamSearchDriver(model, [EOS])
    reqs = [_request(f"x{i}", 1, 8, 4) for i in range(3)]
    try:
        driver.run(reqs)
    except KVCacheExhausted:
        pass
    else:
        raise AssertionError("12 beams of up to 10 tokens cannot fit 9 blocks of 2")
    assert not driver.has_unfinished()
    assert model.block_pool.num_free == model.block_pool.num_usable
    model.block_pool.check()
