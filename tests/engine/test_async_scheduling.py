"""Async scheduling (the device token feed) changes when the host plans, never what a request
gets: the same requests give the same tokens, logprobs, text and finish reasons with it on and
off, whatever ends them (length, EOS-like stop tokens, stop strings, aborts), while requests
arrive mid-run; penalised rows count a fed step's pending token; a fed step's unknown token
never reaches the prefix cache; every block comes back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from metrale import Engine, EngineConfig, SamplingParams
from metrale.engine.request import RequestOutput
from metrale.model_engine.traits import FED_TOKEN, FeedSource
from metrale.scheduler.core import Scheduler, SchedulerConfig
from metrale.scheduler.plan import StepPlan
from metrale.scheduler.sequence import SchedSequence
from tests.helpers.checkpoints import DENSE_VARIANTS, HYBRID_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.parity import mixed_prompts

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")


def new_engine(async_scheduling: bool, **kwargs: Any) -> Engine:
    kwargs.setdefault("num_kv_blocks", 160)
    return Engine(
        EngineConfig(
            model=str(build(VARIANT)),
            device="cpu",
            dtype="float32",
            async_scheduling=async_scheduling,
            **kwargs,
        )
    )


def summary(out: RequestOutput) -> tuple[Any, ...]:
    return tuple(
        (
            c.token_ids,
            c.text,
            c.finish_reason,
            c.stop_reason,
            None if c.logprobs is None else [sorted(p.items()) for p in c.logprobs],
        )
        for c in out.outputs
    )


def assert_same(got: dict[str, tuple[Any, ...]], expected: dict[str, tuple[Any, ...]]) -> None:
    """Equal outputs; logprob values within 1e-5 (batch shapes differ between the two runs,
    so float reductions may round differently; tokens, ranks and text may not differ)."""
    assert got.keys() == expected.keys()
    for rid, choices in expected.items():
        assert len(got[rid]) == len(choices)
        for g, e in zip(got[rid], choices):
            assert g[:4] == e[:4], rid
            assert (g[4] is None) == (e[4] is None), rid
            for gp, ep in zip(g[4] or (), e[4] or (), strict=True):
                assert [(t, lp.rank) for t, lp in gp] == [(t, lp.rank) for t, lp in ep], rid
                for (_, gl), (_, el) in zip(gp, ep):
                    assert abs(gl.logprob - el.logprob) < 1e-5, rid


def run(
    engine: Engine,
    requests: list[tuple[str, list[int], SamplingParams]],
    late: list[tuple[str, list[int], SamplingParams]] = (),  # type: ignore[assignment]
    abort: str | None = None,
) -> dict[str, tuple[Any, ...]]:
    """Run to completion; `late` requests arrive after three steps, `abort` is aborted as
    soon as it has two tokens. Returns each request's final output summary."""
    finals: dict[str, tuple[Any, ...]] = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if abort is not None and out.request_id == abort and len(out.outputs[0].token_ids) >= 2:
                engine.abort_request(abort)
                abort = None
            if out.finished:
                finals[out.request_id] = summary(out)
        steps += 1
        if steps == 3:
            for rid, prompt, params in late:
                engine.add_request(rid, prompt, params)
    return finals


def workload() -> tuple[list[Any], list[Any]]:
    prompts = mixed_prompts(8)
    probe = new_engine(False)
    greedy = run(probe, [("probe", prompts[0], SamplingParams(temperature=0, max_tokens=24))])
    probe_ids, probe_text = greedy["probe"][0][0], greedy["probe"][0][1]
    stop_text = probe_text[len(probe_text) // 2 :][:3]
    early = [
        ("greedy", prompts[0], SamplingParams(temperature=0, max_tokens=20)),
        ("stop-token", prompts[0], SamplingParams(temperature=0, stop_token_ids=[probe_ids[6]])),
        ("stop-text", prompts[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop_text])),
        (
            "seeded",
            prompts[1],
            SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, logprobs=2, max_tokens=17),
        ),
        ("min", prompts[2], SamplingParams(temperature=1.0, seed=5, min_tokens=9, max_tokens=12)),
        ("n2", prompts[3], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=15)),
        ("aborted", prompts[4], SamplingParams(temperature=0, max_tokens=30)),
        ("one", prompts[5], SamplingParams(temperature=0, max_tokens=1)),
    ]
    late = [
        ("late-a", prompts[6], SamplingParams(temperature=0, max_tokens=11)),
        ("late-b", prompts[7], SamplingParams(temperature=0.7, seed=11, max_tokens=9)),
    ]
    return early, late


def test_fed_steps_change_no_output() -> None:
    early, late = workload()
    sync_engine, async_engine = new_engine(False), new_engine(True)
    expected = run(sync_engine, early, late, abort="aborted")
    got = run(async_engine, early, late, abort="aborted")
    assert_same(got, expected)
    assert sync_engine.fed_steps == 0
    assert async_engine.fed_steps > 10, "the workload never ran a fed step"
    assert async_engine.drained_steps > 0, "the late arrivals never drained the pipeline"
    assert expected["stop-token"][0][2] == "stop" and expected["stop-text"][0][2] == "stop"
    for engine in (sync_engine, async_engine):
        assert_no_leaks(engine)


def test_fed_steps_under_preemption_and_a_small_pool() -> None:
    prompts = mixed_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=40)
    requests = [(f"r{i}", p, params) for i, p in enumerate(prompts)]
    expected = run(new_engine(False, num_kv_blocks=40), requests)
    engine = new_engine(True, num_kv_blocks=40)
    assert_same(run(engine, requests), expected)
    assert engine.scheduler.stats.preemptions_recompute > 0
    assert engine.fed_steps > 0
    assert_no_leaks(engine)


def test_penalised_rows_are_fed_with_their_pending_token_counted() -> None:
    """Penalties count every generated token: a fed row's token, not yet on the host, is
    counted on the device. Penalised rows share the batch with plain ones (a row subset)."""
    prompts = mixed_prompts(4)
    params = [
        SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=14),
        SamplingParams(temperature=0.8, seed=2, max_tokens=14, frequency_penalty=0.7),
        SamplingParams(temperature=0, max_tokens=14, presence_penalty=1.5),
    ]
    requests = [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]
    expected = run(new_engine(False), requests)
    engine = new_engine(True)
    assert_same(run(engine, requests), expected)
    assert engine.fed_steps > 5


def test_prefix_cache_never_indexes_a_fed_token() -> None:
    engine = new_engine(True)
    prompts = mixed_prompts(6)
    # Ends by stop token, by abort and by length while fed steps of them are in flight.
    probe = run(
        new_engine(False), [("p", prompts[0], SamplingParams(temperature=0, max_tokens=40))]
    )
    stop_id = probe["p"][0][0][17]
    requests = [
        (f"r{i}", p, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]))
        for i, p in enumerate(prompts)
    ]
    run(engine, requests, abort="r3")
    cache = engine.model.prefix_cache
    assert cache is not None and cache.cached_block_ids()
    stack = list(cache.roots.values())
    while stack:
        node = stack.pop()
        assert FED_TOKEN not in node.chunk
        stack.extend(node.children.values())
    assert engine.fed_steps > 0
    assert_no_leaks(engine)


class _Pool:
    """The part of `Model` the scheduler's planning reads, with a settable free count."""

    def __init__(self, free: int) -> None:
        self.free = free

    def kv_block_size(self) -> int:
        return 4

    def num_total_slots(self) -> None:
        return None

    def resident_blocks_limit(self) -> None:
        return None

    def num_free_blocks(self) -> int:
        return self.free

    def num_total_blocks(self) -> int:
        return 100


class _State:
    def __init__(self, seq_len: int, blocks: int) -> None:
        self.seq_len = seq_len
        self.block_table = list(range(blocks))


def _running(
    scheduler: Scheduler, sid: str, prompt: int, out: int, max_tokens: int
) -> SchedSequence:
    from metrale.scheduler.sequence import Status

    seq = SchedSequence(sid, sid, list(range(prompt)), SamplingParams(), max_tokens, frozenset())
    seq.output_token_ids = list(range(out))
    seq.state = _State(prompt + out + 1, -(-(prompt + out + 1) // 4))  # type: ignore[assignment]
    seq.status = Status.RUNNING
    scheduler.running.append(seq)
    scheduler.by_id[sid] = seq
    return seq


def test_plan_fed_step_rules() -> None:
    pool = _Pool(free=10)
    scheduler = Scheduler(
        pool, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    )  # type: ignore[arg-type]
    a = _running(scheduler, "a", prompt=6, out=2, max_tokens=10)
    b = _running(scheduler, "b", prompt=3, out=3, max_tokens=4)  # its in-flight token is its last
    c = _running(scheduler, "c", prompt=6, out=1, max_tokens=10)  # position 8: a new block
    prev = StepPlan(decode=[a, b, c])
    plan = scheduler.plan_fed_step(prev)
    assert plan is not None and plan.decode == [a, c] and plan.feed_rows == [0, 2]
    pool.free = 0  # c needs a block: a preemption may be ahead, so plan normally
    assert scheduler.plan_fed_step(prev) is None
    pool.free = 10
    waiting = SchedSequence("w", "w", [1, 2], SamplingParams(), 4, frozenset())
    scheduler.add(waiting)  # admissible (3 of 4 seqs running): plan normally
    assert scheduler.plan_fed_step(prev) is None
    scheduler.config.max_num_seqs = 3  # no room to admit: keep feeding
    assert scheduler.plan_fed_step(prev) is not None
    assert scheduler.plan_fed_step(StepPlan(decode=[a, c])) is None  # b is running, unplanned


@pytest.mark.parametrize("name", ["bamba", "qwen3next"])
def test_hybrid_models_fed_steps_change_no_output(name: str) -> None:
    """Recurrent (SSM / gated-delta) state advances once per fed step, rows in slot order."""
    variant = next(v for v in HYBRID_VARIANTS if v.name == name)

    def engine(async_scheduling: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=str(build(variant)), device="cpu", dtype="float32", num_kv_blocks=160,
                max_num_seqs=4, async_scheduling=async_scheduling,
            )
        )  # fmt: skip

    prompts = mixed_prompts(5)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1)
    early = [(f"r{i}", p, params) for i, p in enumerate(prompts[:3])]
    late = [("late", prompts[3], SamplingParams(temperature=0.9, seed=4, max_tokens=7))]
    expected = run(engine(False), early, late)
    fed = engine(True)
    assert_same(run(fed, early, late), expected)
    assert fed.fed_steps > 0 and fed.drained_steps > 0
    assert_no_leaks(fed)


def test_decode_batch_fed_refuses_bad_sources() -> None:
    engine = new_engine(True)
    model = engine.model
    seq = model.alloc_sequence()
    feed = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="needs `feed`"):
        model.decode_batch_fed([FeedSource(from_row=0)], [seq])
    with pytest.raises(ValueError, match="row of the previous step's 2 tokens"):
        model.decode_batch_fed([FeedSource(from_row=5)], [seq], feed=feed)
    with pytest.raises(ValueError, match="host tokens go through decode_batch"):
        model.decode_batch_fed([FeedSource(host_token=3)], [seq], feed=feed)
    with pytest.raises(ValueError, match="differ in length"):
        model.decode_batch_fed([FeedSource(from_row=0)], [], feed=feed)
    model.free_sequence(seq)
