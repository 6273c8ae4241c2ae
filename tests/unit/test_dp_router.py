"""The data-parallel router's policy (`metrale.engine.router`) and the pure parts of
`metrale.engine.replicas` (snapshot sums, replica environments, the handle's routing, retry and
control fan-out over fake replicas): plain Python, no engine, no processes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from metrale.engine.replicas import ReplicatedEngine, replica_envs, sum_snapshots
from metrale.engine.router import PrefixRouter, block_hashes
from metrale.engine.snapshot import EngineInfo, EngineSnapshot
from metrale.errors import EngineDeadError, InvalidRequestError, MetraleError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import SamplingParams
from metrale.scheduler.core import SchedulerStats
from metrale.spec.stats import SpecStats

BS = 4


def _ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# --------------------------------------------------------------------------- block hashes


def test_block_hashes_are_chained_block_aligned_and_namespaced() -> None:
    a = block_hashes(_ids(14), BS)
    assert len(a) == 3  # the partial last block is not named
    b = block_hashes(_ids(8) + [99] * 6, BS)
    assert a[:2] == b[:2] and a[2] != b[2]
    # A change in block 0 changes every later hash (chained), even where the tokens agree.
    c = block_hashes([7, *_ids(13, 1)], BS)
    assert all(x != y for x, y in zip(a, c, strict=True))
    assert block_hashes(_ids(3), BS) == []
    # Adapters and tenants (cache_salt) never share a block, as in the engine's prefix cache.
    assert set(block_hashes(_ids(14), BS, adapter_id=1)).isdisjoint(a)
    assert set(block_hashes(_ids(14), BS, cache_namespace="salt:x")).isdisjoint(a)
    assert block_hashes(_ids(14), BS, cache_namespace="") == a
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(_ids(4), 0)


# ---------------------------------------------------------------------------------- policy


def test_no_record_goes_to_least_loaded_and_equal_loads_spread() -> None:
    router = PrefixRouter(3)
    d = router.choose(block_hashes(_ids(8), BS), [2, 0, 1], [True] * 3)
    assert (d.replica, d.reason, d.matched_blocks) == (1, "load", 0)
    # Equal loads: the replica sent fewest requests, so a burst spreads over all of them.
    seen = []
    for i in range(3):
        d = router.choose(block_hashes(_ids(8, 100 * i), BS), [0, 0, 0], [True] * 3)
        router.record(d.replica, block_hashes(_ids(8, 100 * i), BS))
        seen.append(d.replica)
    assert sorted(seen) == [0, 1, 2]


def test_a_repeated_prefix_goes_to_its_replica_within_the_margin() -> None:
    router = PrefixRouter(2, load_margin=2)
    prefix = _ids(40)
    first = block_hashes([*prefix, 500], BS)
    router.record(1, first)
    for k, loads in enumerate(([0, 0], [0, 1], [0, 2], [3, 5])):
        h = block_hashes([*prefix, 600 + k, 601], BS)
        d = router.choose(h, loads, [True, True])
        assert (d.replica, d.reason, d.matched_blocks) == (1, "prefix", 10), loads
    # Overloaded by more than the margin: the least loaded replica takes it.
    d = router.choose(block_hashes(prefix, BS), [0, 3], [True, True])
    assert (d.replica, d.reason) == (0, "load")


def test_the_longest_recorded_prefix_wins_and_equal_matches_go_to_the_lighter() -> None:
    router = PrefixRouter(3)
    router.record(0, block_hashes(_ids(8), BS))  # 2 blocks of the prompt
    router.record(2, block_hashes(_ids(20), BS))  # 5 blocks
    prompt = block_hashes(_ids(24), BS)
    d = router.choose(prompt, [0, 0, 1], [True] * 3)
    assert (d.replica, d.matched_blocks, d.reason) == (2, 5, "prefix")
    router.record(0, block_hashes(_ids(20), BS))
    d = router.choose(prompt, [1, 0, 0], [True] * 3)
    assert (d.replica, d.matched_blocks) == (2, 5)
    d = router.choose(prompt, [0, 0, 1], [True] * 3)
    assert (d.replica, d.matched_blocks) == (0, 5)


def test_other_namespaces_do_not_match() -> None:
    router = PrefixRouter(2)
    router.record(1, block_hashes(_ids(40), BS, cache_namespace="salt:a"))
    d = router.choose(block_hashes(_ids(40), BS, cache_namespace="salt:b"), [0, 0], [True] * 2)
    assert d.reason == "load" and d.matched_blocks == 0
    d = router.choose(block_hashes(_ids(40), BS, cache_namespace="salt:a"), [0, 0], [True] * 2)
    assert (d.replica, d.reason) == (1, "prefix")


def test_unavailable_replicas_are_skipped_and_none_is_an_error() -> None:
    router = PrefixRouter(2)
    h = block_hashes(_ids(16), BS)
    router.record(0, h)
    d = router.choose(h, [0, 9], [False, True])
    assert (d.replica, d.reason) == (1, "load")
    with pytest.raises(ValueError, match="no replica"):
        router.choose(h, [0, 0], [False, False])
    with pytest.raises(ValueError, match="one entry per replica"):
        router.choose(h, [0], [True])


def test_the_record_is_a_bounded_lru_and_forget_clears_it() -> None:
    router = PrefixRouter(2, capacity=6)
    old, new = block_hashes(_ids(16), BS), block_hashes(_ids(16, 1000), BS)
    router.record(0, old)
    router.record(0, old[:1])  # refresh block 0 only
    router.record(0, new)  # 4 more: evicts the 2 least recently used (old blocks 1, 2)
    assert router.recorded_blocks(0) == 6
    assert router.matched_blocks(0, new) == 4
    assert router.matched_blocks(0, old[:3]) == 1  # blocks 1-2 were evicted, block 0 kept
    assert router.matched_blocks(0, old) == 4  # the deepest hash survived: it names the prefix
    router.record(0, block_hashes(_ids(8, 5000), BS))  # evicts old blocks 3 and 0
    assert router.matched_blocks(0, old) == 0 and router.matched_blocks(0, new) == 4
    router.forget(0)
    assert router.recorded_blocks(0) == 0 and router.matched_blocks(0, new) == 0
    with pytest.raises(ValueError):
        PrefixRouter(0)
    with pytest.raises(ValueError):
        PrefixRouter(2, load_margin=-1)


# ------------------------------------------------------------------------ replicas helpers


def test_sum_snapshots_adds_every_counter() -> None:
    a = EngineSnapshot(
        num_running=2, num_free_blocks=10, num_steps=5, stats=SchedulerStats(prefix_hit_tokens=32),
        prefix_cache={"evicted_blocks": 1}, spec=SpecStats(num_drafts=1, accepted_per_pos=[1]),
    )  # fmt: skip
    b = EngineSnapshot(
        num_running=1, num_free_blocks=7, num_steps=1, alive=False,
        stats=SchedulerStats(prefix_hit_tokens=16, extra={"x": 2}),
        prefix_cache={"evicted_blocks": 2, "bypassed_lookups": 3},
        spec=SpecStats(num_drafts=2, accepted_per_pos=[2, 1]),
    )  # fmt: skip
    s = sum_snapshots([a, b])
    assert (s.num_running, s.num_free_blocks, s.num_steps, s.alive) == (3, 17, 6, True)
    assert s.stats.prefix_hit_tokens == 48 and s.stats.extra == {"x": 2}
    assert s.prefix_cache == {"evicted_blocks": 3, "bypassed_lookups": 3}
    assert s.spec.num_drafts == 3 and s.spec.accepted_per_pos == [3, 1]
    assert not sum_snapshots([b]).alive


def test_replica_envs() -> None:
    envs = replica_envs("cuda", 2, environ={}, cuda_count=lambda: 4)
    assert envs == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    envs = replica_envs("auto", 2, environ={"CUDA_VISIBLE_DEVICES": "5,7"}, cuda_count=lambda: 2)
    assert envs == [{"CUDA_VISIBLE_DEVICES": "5"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    with pytest.raises(InvalidRequestError, match="needs 3 GPUs"):
        replica_envs("cuda", 3, environ={}, cuda_count=lambda: 2)
    assert replica_envs("cpu", 2, environ={}, cpu_count=8) == [{"OMP_NUM_THREADS": "4"}] * 2
    assert (
        replica_envs("auto", 3, environ={}, cuda_count=lambda: 0, cpu_count=2)
        == [{"OMP_NUM_THREADS": "1"}] * 3
    )
    assert replica_envs("cpu", 2, environ={"OMP_NUM_THREADS": "1"}) == [{}, {}]


# ------------------------------------------------------------- the handle over fake replicas


def _info(**changes: Any) -> EngineInfo:
    base = dict(
        served_model_name="m", model_dir="/m", max_model_len=256, device="cpu",
        dtype="float32", num_total_blocks=64, kv_block_size=BS,
        sampling_defaults=SamplingDefaults(),
    )  # fmt: skip
    return EngineInfo(**{**base, **changes})


@dataclass
class FakeReplica:
    """Enough of `EngineHandle` for the router: adds are recorded, death is a flag."""

    info: EngineInfo = field(default_factory=_info)
    tokenizer: Any = None
    dead: bool = False
    die_on_add: bool = False
    open: int = 0
    restarts: int = 0
    added: list[str] = field(default_factory=list)
    controls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)

    @property
    def dead_error(self) -> MetraleError | None:
        return EngineDeadError("replica is dead") if self.dead else None

    @property
    def is_running(self) -> bool:
        return not self.dead

    def num_open_requests(self) -> int:
        return self.open

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(num_running=self.open, alive=not self.dead)

    async def add_request(self, request_id: str, prompt: Any, params: Any, **kw: Any) -> str:
        if self.die_on_add:
            self.dead = True
            raise EngineDeadError("the engine process exited")
        self.added.append(request_id)
        self.open += 1
        return request_id

    async def control(self, method: str, *args: Any) -> Any:
        self.controls.append((method, args))
        return args[2] if method == "load_lora_adapter" else None


def _add(engine: ReplicatedEngine, rid: str, ids: list[int], **kw: Any) -> Any:
    return asyncio.run(engine.add_request(rid, None, SamplingParams(), prompt_token_ids=ids, **kw))


def test_the_handle_routes_prefixes_and_balances_load() -> None:
    reps = [FakeReplica(), FakeReplica()]
    engine = ReplicatedEngine(reps, load_margin=1)
    assert engine.info.num_total_blocks == 128
    _add(engine, "a", _ids(40))
    _add(engine, "b", _ids(40, 500))
    assert reps[0].added == ["a"] and reps[1].added == ["b"]
    _add(engine, "a2", [*_ids(40), 1, 2])  # loads 1/1: its prefix holder
    assert reps[0].added == ["a", "a2"]
    _add(engine, "a3", [*_ids(40), 3])  # loads 2/1: still within the margin
    _add(engine, "a4", [*_ids(40), 4])  # loads 3/1: over it
    assert reps[0].added == ["a", "a2", "a3"] and reps[1].added == ["b", "a4"]
    stats = engine.replica_stats()
    assert (stats[0].routed_prefix, stats[0].routed_load) == (2, 1)
    assert stats[0].routed_matched_tokens == 2 * 40
    assert engine.snapshot().num_running == 5


def test_a_dead_replica_is_skipped_and_an_add_it_refused_is_retried() -> None:
    reps = [FakeReplica(), FakeReplica()]
    engine = ReplicatedEngine(reps)
    _add(engine, "a", _ids(40))
    reps[0].die_on_add = True
    _add(engine, "a2", [*_ids(40), 9])  # routed to 0 (its prefix), refused, retried on 1
    assert reps[1].added == ["a2"] and engine.dead_error is None and engine.is_running
    assert engine.replica_stats()[0].recorded_blocks == 0  # its record is gone
    # Replica 1 restarts (its supervisor brought up a fresh engine): its cache is empty, so
    # the router forgets what it sent there; the prefix goes by load again.
    assert engine.router.matched_blocks(1, block_hashes(_ids(40), BS)) == 10
    reps[1].restarts = 1
    reps[0].dead, reps[0].die_on_add = False, False
    _add(engine, "a3", [*_ids(40), 8])
    stats = engine.replica_stats()
    assert reps[1].added == ["a2", "a3"] and reps[0].added == ["a"]
    assert (stats[1].routed_prefix, stats[1].routed_load) == (0, 2)  # without the restart: 1, 1
    reps[0].dead = reps[1].dead = True
    assert engine.dead_error is not None and not engine.is_running
    with pytest.raises(EngineDeadError, match="all 2 data-parallel replicas are down"):
        _add(engine, "c", _ids(8))


def test_control_reaches_every_replica_once() -> None:
    reps = [FakeReplica(), FakeReplica()]
    engine = ReplicatedEngine(reps)

    async def load() -> Any:
        return await engine.control("load_lora_adapter", "x", "/a/x", 7)

    assert asyncio.run(load()) == 7
    assert all(r.controls == [("load_lora_adapter", ("x", "/a/x", 7))] for r in reps)
    # The server's reload after a restart: only the restarted replica gets it again.
    reps[1].restarts = 1
    assert asyncio.run(load()) == 7
    assert len(reps[0].controls) == 1 and len(reps[1].controls) == 2


def test_replicas_of_different_models_are_refused() -> None:
    with pytest.raises(MetraleError, match="differ in max_model_len"):
        ReplicatedEngine([FakeReplica(), FakeReplica(info=_info(max_model_len=512))])
    with pytest.raises(MetraleError, match="differ in vision"):
        ReplicatedEngine([FakeReplica(), FakeReplica(info=_info(vision=object()))])
    ReplicatedEngine([FakeReplica(), FakeReplica(info=_info(num_total_blocks=9))])
    ReplicatedEngine(  # each replica builds its own vision front end: compared by presence
        [FakeReplica(info=_info(vision=object())), FakeReplica(info=_info(vision=object()))]
    )


def test_serve_flags() -> None:
    from metrale.cli import build_parser
    from metrale.server.serve_flags import check_vllm_compat_flags

    parser = build_parser()
    args = parser.parse_args(["serve", "m", "-dp", "2", "--data-parallel-load-margin", "0"])
    check_vllm_compat_flags(args)
    assert (args.data_parallel_size, args.data_parallel_load_margin) == (2, 0)
    assert parser.parse_args(["serve", "m"]).data_parallel_size == 1
    for bad, message in (
        (["--data-parallel-size", "0"], "must be >= 1"),
        (["-dp", "2", "--engine-in-process"], "own process"),
        (["--data-parallel-load-margin", "-1"], "load-margin"),
    ):
        with pytest.raises(InvalidRequestError, match=message) as err:
            check_vllm_compat_flags(parser.parse_args(["serve", "m", *bad]))
        assert err.value.param in ("data_parallel_size", "data_parallel_load_margin")
