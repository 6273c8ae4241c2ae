"""Property-based test of the KV accounting with the prefix cache on: over random sequences of
add / step / abort (and the finishes they cause), every block's reference count equals the
cache's hold plus the sequences holding it, no referenced block is ever evicted or freed,
free + cache-only + referenced blocks always equal the pool, and nothing leaks at the end."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale import Engine, EngineConfig, SamplingParams
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
PREFIXES = [list(range(10, 10 + n)) for n in (16, 24, 40)]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 20), st.integers(1, 24)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
    ),
    min_size=5,
    max_size=40,
)


def check_accounting(engine: Engine) -> None:
    model = engine.model
    pool = model.block_pool
    pool.check()
    cache = model.prefix_cache
    assert cache is not None
    cached = cache.cached_block_ids()
    assert len(cached) == len(set(cached)), "a block is cached twice"
    holders: Counter[int] = Counter()
    for seq in engine.scheduler.running:
        assert seq.state is not None
        assert len(seq.state.block_table) == len(set(seq.state.block_table))
        holders.update(seq.state.block_table)
    for seq in [*engine.scheduler.waiting, *engine.scheduler.swapped]:
        assert seq.state is None, "a queued sequence still holds device state"
    for block in range(1, pool.num_blocks):
        expected = holders[block] + (block in set(cached))
        assert pool.ref_count(block) == expected, f"block {block}"
    cache_only = sum(1 for b in cached if holders[b] == 0)
    assert pool.num_free + cache_only + len(holders) == pool.num_usable


def watch_evictions(engine: Engine) -> None:
    """Make every eviction assert that it freed only blocks no sequence referenced."""
    cache, pool = engine.model.prefix_cache, engine.model.block_pool
    assert cache is not None
    evict = cache.evict

    def checked(n: int, protected: set[int] | None = None) -> int:
        before = set(cache.cached_block_ids())
        freed = evict(n, protected)
        gone = before - set(cache.cached_block_ids())
        assert len(gone) == freed
        assert all(pool.ref_count(b) == 0 for b in gone), "evicted a block a sequence holds"
        return freed

    cache.evict = checked  # type: ignore[method-assign]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_traffic_keeps_block_accounting_exact(
    script: list[tuple[str, int, int, int]],
) -> None:
    engine = Engine(
        EngineConfig(model=str(build(VARIANT)), device="cpu", num_kv_blocks=14, max_num_seqs=4)
    )
    watch_evictions(engine)
    live: list[str] = []
    counter = 0
    for op, a, b, c in script:
        if op == "add":
            prompt = PREFIXES[a] + list(range(200, 200 + b))
            rid = f"r{counter}"
            counter += 1
            engine.add_request(
                rid, prompt, SamplingParams(temperature=0, max_tokens=c, ignore_eos=True)
            )
            live.append(rid)
        elif op == "step":
            for _ in range(a):
                for out in engine.step():
                    if out.finished and out.request_id in live:
                        live.remove(out.request_id)
        elif live:
            engine.abort_request(live.pop(a % len(live)))
        check_accounting(engine)
    while engine.has_unfinished():
        engine.step()
        check_accounting(engine)
    assert_no_leaks(engine)
