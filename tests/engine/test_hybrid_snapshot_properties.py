"""Hybrid prefix caching under pressure: random traffic (add / step / abort over shared system
prompts) on a Nemotron-H tiny checkpoint with a snapshot store of one or two slots and a tight
KV pool (so snapshots are evicted, and KV eviction drops snapshots with their nodes) gives every
finished request exactly the tokens of a cache-off run, and the block and snapshot accounting
is exact after every operation and empty at the end; and every snapshot still cached at the end
of a script holds the state a cold prefill of its node's path leaves (to 1e-4 of
the state's scale)."""

from __future__ import annotations

import functools
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale import Engine, EngineConfig, SamplingParams
from tests.helpers.checkpoints import HYBRID_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks, assert_snapshots_match_cold

VARIANT = next(v for v in HYBRID_VARIANTS if v.name == "nemotronh-moe")
PREFIXES = [list(range(10, 10 + n)) for n in (20, 37, 50)]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 20), st.integers(1, 24)),
        st.tuples(st.just("step"), st.integers(1, 6), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
    ),
    min_size=5,
    max_size=30,
)


def engine(**kwargs: object) -> Engine:
    config = dict(model=str(build(VARIANT)), device="cpu", max_num_seqs=4)
    config.update(kwargs)
    return Engine(EngineConfig(**config))  # type: ignore[arg-type]


@functools.cache
def reference() -> Engine:
    return engine(enable_prefix_caching=False, num_kv_blocks=64)


@functools.cache
def expected(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    ref = reference()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref.add_request("ref", None, params, prompt_token_ids=list(prompt))
    tokens: list[int] = []
    while ref.has_unfinished():
        for out in ref.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return tokens


def check_accounting(eng: Engine) -> None:
    model = eng.model
    pool, cache, store = model.block_pool, model.prefix_cache, model.snapshots
    assert cache is not None and store is not None
    pool.check()
    store.check()
    cached = cache.cached_block_ids()
    holders: Counter[int] = Counter()
    tracks = 0
    for seq in eng.scheduler.running:
        assert seq.state is not None
        holders.update(seq.state.block_table)
        tracks += seq.state.ssm_track is not None
    for seq in [*eng.scheduler.waiting, *eng.scheduler.swapped]:
        assert seq.state is None
    for block in range(1, pool.num_blocks):
        assert pool.ref_count(block) == holders[block] + (block in set(cached)), block
    assert store.num_private() == tracks, "a decode track without a running sequence"
    nodes = [c for root in cache.roots.values() for c in root.children.values()]
    published = 0
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children.values())
        if node.snapshot is not None:
            published += 1
            depth, up = 0, node
            while up.parent is not None:
                depth, up = depth + cache.block_size, up.parent
            assert node.snapshot.tokens == depth, "a snapshot on the wrong node"
    assert published == store.num_published()


def run_script(eng: Engine, script: list[tuple[str, int, int, int]]) -> None:
    live: dict[str, tuple[tuple[int, ...], int]] = {}
    counter = 0

    def collect(outs: list) -> None:
        for out in outs:
            if out.finished and out.request_id in live:
                prompt, max_tokens = live.pop(out.request_id)
                assert list(out.outputs[0].token_ids) == expected(prompt, max_tokens)

    for op, a, b, c in script:
        if op == "add":
            prompt = tuple(PREFIXES[a] + list(range(200, 200 + b)))
            rid = f"r{counter}"
            counter += 1
            params = SamplingParams(temperature=0, max_tokens=c, ignore_eos=True)
            eng.add_request(rid, None, params, prompt_token_ids=list(prompt))
            live[rid] = (prompt, c)
        elif op == "step":
            for _ in range(a):
                collect(eng.step())
        elif live:
            rid = sorted(live)[a % len(live)]
            del live[rid]
            eng.abort_request(rid)
        check_accounting(eng)
    while eng.has_unfinished():
        collect(eng.step())
        check_accounting(eng)
    assert not live
    assert_snapshots_match_cold(eng.model, reference().model)
    assert_no_leaks(eng)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.integers(1, 2))
def test_random_traffic_with_a_tiny_snapshot_store_matches_cache_off(
    script: list[tuple[str, int, int, int]], slots: int
) -> None:
    run_script(engine(num_kv_blocks=20, ssm_snapshot_slots=slots), script)


def test_a_one_slot_store_evicts_and_still_matches_cache_off() -> None:
    eng = engine(num_kv_blocks=40, ssm_snapshot_slots=1)
    script = [("add", i % 3, i, 18) for i in range(9)]
    run_script(eng, [op for add in script for op in (add, ("step", 5, 0, 0))])
    stats = eng.model.prefix_cache_stats()
    assert stats["ssm_snapshot_evictions"] > 0 and stats["ssm_snapshot_hits"] > 0
    assert stats["ssm_snapshot_miss_evicted"] > 0
