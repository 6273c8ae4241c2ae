"""SSM slot accounting on hybrid models: after any mix of finishes, aborts (waiting, running,
swapped), errors and preemptions (recompute and swap) every slot is free again; preempted
sequences still produce the tokens of an unpreempted run; admission never needs more slots
than are free; decode rows run in slot order; `compact_sequence` moves state bit-exactly and
`detach_slot_for_reuse` keeps the survivor's slot."""

from __future__ import annotations

import gc

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.cache.ssm_pool import SsmLayerSpec, SsmSlotPool
from metrale.errors import KVCacheExhausted
from metrale.model_engine.traits import DETACHED_SLOT
from metrale.scheduler.core import Scheduler, SchedulerConfig
from metrale.scheduler.plan import StepPlan
from tests.helpers.checkpoints import HYBRID_VARIANTS, build

VARIANT = next(v for v in HYBRID_VARIANTS if v.name == "qwen3next")
MAMBA = next(v for v in HYBRID_VARIANTS if v.name == "nemotronh-moe")


def workload(n: int = 12, new_tokens: int = 24) -> tuple[list[list[int]], SamplingParams]:
    g = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(6, 512, (int(k),), generator=g).tolist()
        for k in torch.randint(4, 30, (n,), generator=g)
    ]
    return prompts, SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)


def assert_all_free(llm: LLM) -> None:
    model = llm.engine.model
    assert not llm.engine.has_unfinished()
    pool = model.ssm_pool
    assert pool.num_free() == pool.num_slots and pool.num_allocated() == 0
    model.reclaim_prefix_blocks(model.num_total_blocks())
    assert model.num_free_blocks() == model.num_total_blocks()


# ----------------------------------------------------------------------------- the pool


def test_pool_hands_out_lowest_slots_and_guards_release_once() -> None:
    pool = SsmSlotPool([SsmLayerSpec((3, 4), (2, 2, 2))], 3, torch.float32, torch.device("cpu"))
    assert pool.ssm_states[0].dtype == torch.float32
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert [a.idx(), b.idx(), c.idx()] == [0, 1, 2]
    with pytest.raises(KVCacheExhausted):
        pool.allocate()
    b.release()
    b.release()  # a second release frees nothing
    assert pool.num_free() == 1 and b.idx() is None
    d = pool.allocate()
    assert d.idx() == 1
    del c  # a dropped guard returns its slot (the seed's Drop)
    gc.collect()
    assert pool.is_free(2)
    a.release()
    d.release()
    assert pool.num_free() == 3


# ---------------------------------------------------------------- compact and detach


@pytest.mark.parametrize("detach_first", [True, False])
def test_compact_moves_state_bit_exactly_and_detach_keeps_the_survivor_slot(
    detach_first: bool,
) -> None:
    llm = LLM(str(build(MAMBA)), device="cpu", num_kv_blocks=64, max_num_seqs=4)
    model = llm.engine.model
    pool = model.ssm_pool
    prompts, _ = workload(2)
    retired, survivor, twin = (model.alloc_sequence() for _ in range(3))
    assert [retired.slot_idx, survivor.slot_idx, twin.slot_idx] == [0, 1, 2]
    model.prefill(prompts[0], retired)
    model.prefill(prompts[1], survivor)
    model.prefill(prompts[1], twin)  # same history, never moved: the reference
    before = [(conv[1].clone(), ssm[1].clone()) for conv, ssm in pool.layers]
    if detach_first:
        model.detach_slot_for_reuse(retired)
        model.compact_sequence(survivor, 0)
    else:
        model.compact_sequence(survivor, 0)
        model.detach_slot_for_reuse(retired)
    assert survivor.slot_idx == survivor.ssm_slot_idx() == 0
    assert retired.slot_idx == DETACHED_SLOT and retired.ssm_slot is None
    for (conv, ssm), (conv_before, ssm_before) in zip(pool.layers, before, strict=True):
        assert torch.equal(conv[0], conv_before) and torch.equal(ssm[0], ssm_before)
    assert pool.is_free(1) and not pool.is_free(0)
    model.free_sequence(retired)  # frees its KV, not the survivor's slot
    assert not pool.is_free(0)
    # The moved state continues exactly like the unmoved twin (same computation, other slot).
    assert torch.equal(model.decode(9, survivor), model.decode(9, twin))
    model.free_sequence(survivor)
    model.free_sequence(twin)
    assert pool.num_free() == pool.num_slots


# ------------------------------------------------------------- engine exit paths


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_keep_tokens_and_return_every_slot(mode: str) -> None:
    prompts, params = workload()
    ample = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=200, max_num_seqs=8)
    expected = [o.outputs[0].token_ids for o in ample.generate(prompts, params)]
    tight = LLM(
        str(build(VARIANT)), device="cpu", num_kv_blocks=12, max_num_seqs=8, preemption_mode=mode
    )
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    assert got == expected
    stats = tight.engine.scheduler.stats
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    if mode == "swap":
        assert stats.preemptions_recompute == 0
    assert_all_free(tight)


def test_aborts_and_errors_anywhere_return_every_slot() -> None:
    llm = LLM(
        str(build(VARIANT)), device="cpu", num_kv_blocks=10, max_num_seqs=4,
        preemption_mode="swap",
    )  # fmt: skip
    engine = llm.engine
    prompts, params = workload(new_tokens=48)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    module = engine.model.module
    calls = {"n": 0}
    inner = module.forward

    def flaky(*args: object, **kwargs: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 60:
            raise RuntimeError("injected forward failure")
        return inner(*args, **kwargs)

    module.forward = flaky  # type: ignore[method-assign]
    aborted: dict[str, str] = {}
    finished = {}
    for step in range(400):
        if not engine.has_unfinished():
            break
        sched = engine.scheduler
        queues = {"swapped": sched.swapped, "running": sched.running, "waiting": sched.waiting}
        for where, queue in queues.items():  # abort one sequence from each place, once
            if queue and where not in aborted.values() and step >= 3:
                rid = queue[-1].request_id
                engine.abort_request(rid)
                aborted[rid] = where
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    reasons = set(finished.values())
    assert "error" in reasons and "length" in reasons
    assert sorted(aborted.values()) == ["running", "swapped", "waiting"]
    assert engine.scheduler.stats.preemptions_swap > 0
    assert_all_free(llm)


# ------------------------------------------------------------------ scheduling


def test_admission_counts_free_slots_and_decode_rows_run_in_slot_order() -> None:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=100, max_num_seqs=3)
    engine = llm.engine
    model = engine.model
    held = model.alloc_sequence()  # a slot the scheduler does not know about
    prompts, params = workload(6)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    inner = engine.scheduler.schedule
    orders: list[list[int]] = []

    def recording() -> StepPlan:
        plan = inner()
        orders.append([s.state.ssm_slot_idx() for s in plan.decode])
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 2  # 3 slots, one held outside
    assert all(order == sorted(order) for order in orders)
    assert any(len(order) == 2 for order in orders)
    model.free_sequence(held)
    assert_all_free(llm)


def test_max_num_seqs_cannot_exceed_the_slot_pool() -> None:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=32, max_num_seqs=2)
    model = llm.engine.model
    assert model.num_total_slots() == 2
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=256)
    with pytest.raises(ValueError, match="exceeds the model's SSM slot pool"):
        Scheduler(model, config)
