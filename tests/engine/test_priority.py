"""Issue 17: `scheduling_policy="priority"` serves waiting requests by `priority` (lower
first), then arrival; "fcfs" by arrival whatever the priorities; preemption under the
priority policy takes the lowest priority first. Priorities never change a request's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from metrale import SamplingParams
from metrale.config import EngineConfig
from metrale.engine.engine import Engine
from metrale.errors import InvalidRequestError
from tests.server.helpers import tiny_checkpoint

PROMPTS = {"a": "def a(x):", "b": "def b(y):", "c": "class C:", "d": "import os"}
PRIORITIES = {"a": 5, "b": 0, "c": 1, "d": 0}


def run(policy: str, checkpoint: Path, **config: object) -> tuple[list[str], dict[str, list[int]]]:
    engine = Engine(
        EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=64, max_num_seqs=1,
                     scheduling_policy=policy, **config)  # type: ignore[arg-type]
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params, priority=PRIORITIES[rid])
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    return order, tokens


def test_priority_orders_the_queue_and_changes_no_tokens() -> None:
    checkpoint = tiny_checkpoint()
    fcfs_order, fcfs_tokens = run("fcfs", checkpoint)
    prio_order, prio_tokens = run("priority", checkpoint)
    assert fcfs_order == ["a", "b", "c", "d"]
    assert prio_order == ["b", "d", "c", "a"]  # priority, then arrival
    assert prio_tokens == fcfs_tokens


def test_priority_victim_is_the_lowest_priority() -> None:
    from metrale.scheduler.sequence import SchedSequence

    engine = Engine(EngineConfig(model=str(tiny_checkpoint()), device="cpu", num_kv_blocks=64,
                                 scheduling_policy="priority"))  # fmt: skip
    sched = engine.scheduler
    seqs = [
        SchedSequence(seq_id=f"s{i}", request_id=f"s{i}", prompt_token_ids=[1, 2],
                      params=SamplingParams(), max_tokens=4, eos_token_ids=frozenset(),
                      priority=p, arrival=i)
        for i, p in enumerate([3, 7, 7, 0])
    ]  # fmt: skip
    sched.running = seqs
    assert sched._choose_victim().seq_id == "s2"  # priority 7, the later arrival


def test_bad_policy_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lottery")
