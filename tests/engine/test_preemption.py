"""Preemption: with a KV pool so small that sequences are preempted every few steps, 32
concurrent requests (greedy and seeded sampling) produce exactly the tokens of an ample pool,
under swap and under recompute, and every block comes back. A request that can never fit is
refused at once."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.errors import CapacityError
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(6, 512, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 30, (32,), generator=g)
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
        if i % 2 == 0
        else SamplingParams(temperature=0.8, top_k=50, max_tokens=64, min_tokens=64, seed=100 + i)
        for i in range(32)
    ]
    return prompts, params


def run(**kwargs: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(build(VARIANT)), device="cpu", max_num_seqs=32, **kwargs)
    prompts, params = workload()
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)], llm


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_tiny_pool_preempts_and_still_matches_ample_pool(mode: str, prefix_caching: bool) -> None:
    ample, _ = run(num_kv_blocks=400, enable_prefix_caching=prefix_caching)
    tight, llm = run(num_kv_blocks=20, preemption_mode=mode, enable_prefix_caching=prefix_caching)
    assert tight == ample
    stats = llm.engine.scheduler.stats
    preemptions = stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute
    steps = llm.engine.num_steps
    assert preemptions * 12 >= steps, (
        f"{preemptions} preemptions in {steps} steps: the pool is not tight"
    )
    if mode == "swap":
        assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
        assert stats.preemptions_recompute == 0
    assert_no_leaks(llm.engine)


def test_swap_space_exhaustion_falls_back_to_recompute_and_says_so() -> None:
    tight, llm = run(num_kv_blocks=20, preemption_mode="swap", swap_space_gb=1e-5)
    ample, _ = run(num_kv_blocks=400)
    assert tight == ample
    stats = llm.engine.scheduler.stats
    assert stats.swap_fallbacks > 0 and stats.preemptions_recompute > 0
    assert_no_leaks(llm.engine)


def test_swap_past_the_swap_space_spills_to_disk(tmp_path: Path) -> None:
    """Issue 19: with --swap-spill-dir, swap records past the host swap space go to files
    (no recompute fallback), outputs are unchanged, and every file is gone at the end."""
    seen: set[str] = set()
    real = tempfile.TemporaryFile

    def spy(*args: Any, **kwargs: Any) -> Any:
        f = real(*args, **kwargs)
        seen.add(str(kwargs.get("dir")))
        return f

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "TemporaryFile", spy)
        tight, llm = run(num_kv_blocks=20, preemption_mode="swap", swap_space_gb=1e-5,
                         swap_spill_dir=str(tmp_path), swap_spill_gb=1.0)  # fmt: skip
    ample, _ = run(num_kv_blocks=400)
    assert tight == ample
    stats = llm.engine.scheduler.stats
    assert stats.swap_spills > 0 and stats.swap_fallbacks == 0
    assert seen == {str(tmp_path)}
    assert llm.engine.scheduler._spill_bytes == 0
    assert list(tmp_path.iterdir()) == []  # temporary files: nothing left behind
    assert_no_leaks(llm.engine)


def test_preempted_blocks_in_the_cache_are_reclaimed_before_the_last_victim() -> None:
    """Four long sequences on a pool that holds one and a half: each recompute victim's blocks
    go to the prefix cache, and are reclaimed before the next victim is chosen, so the last
    one keeps running (it used to be ended with "error" with 6 cache-only blocks left)."""
    prompts = [list(range(6 + i, 75 + i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, min_tokens=48)
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=14, max_num_seqs=4)
    outs = llm.generate(prompts, params)
    ample = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=64).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ample]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leaks(llm.engine)


def test_a_sequence_ended_for_lack_of_blocks_still_gets_its_final_output() -> None:
    """If blocks leak so that a lone sequence cannot continue, it ends with "error" and its
    request is answered (it used to hang the caller with no final output)."""
    engine = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=16).engine
    engine.add_request("r", list(range(6, 40)), SamplingParams(temperature=0, max_tokens=200))
    engine.step()  # the prefill
    leaked = engine.model.block_pool.allocate(engine.model.num_free_blocks())
    finals = []
    for _ in range(300):
        finals += [o for o in engine.step() if o.finished]
        if finals or not engine.has_unfinished():
            break
    assert [o.outputs[0].finish_reason for o in finals] == ["error"]
    engine.model.block_pool.decref(leaked)
    assert_no_leaks(engine)


def test_request_that_can_never_fit_is_refused() -> None:
    llm = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=8)
    with pytest.raises(CapacityError, match="can never be served"):
        llm.generate([list(range(6, 60))], SamplingParams(max_tokens=200))
    ok = llm.generate(
        [list(range(6, 30))], SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    )
    assert len(ok[0].outputs[0].token_ids) == 8
    assert_no_leaks(llm.engine)


def test_abort_while_swapped_releases_the_swap_record_and_spares_the_rest() -> None:
    prompts, params = workload()
    ample, _ = run(num_kv_blocks=400)
    engine = LLM(
        str(build(VARIANT)), device="cpu", max_num_seqs=32, num_kv_blocks=20,
        preemption_mode="swap",
    ).engine  # fmt: skip
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    sched = engine.scheduler
    finals: dict[str, list[int]] = {}
    while not sched.swapped:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    victim = sched.swapped[0]
    assert victim.swap is not None
    engine.abort_request(victim.request_id)
    assert victim.swap is None and victim.state is None
    assert sched._swap_bytes == sum(s.swap.nbytes for s in sched.swapped if s.swap is not None)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert victim.request_id not in finals
    assert all(finals[f"r{i}"] == ample[i] for i in range(32) if f"r{i}" in finals)
    assert len(finals) == 31
    assert_no_leaks(engine)
