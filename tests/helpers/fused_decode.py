"""The bf16-weights agreement run of the CPU's fused decode step, shared by
`tests/models/test_cpu_fused_decode.py` (which asserts on it) and `tools/host_costs_cpu.py`
(which records it)."""

from __future__ import annotations

import os
from typing import Any

from metrale import Engine, EngineConfig, SamplingParams
from metrale.kernels import cpu_decode
from tests.helpers.checkpoints import build

#: Per request id: its greedy tokens and their logprobs.
Run = dict[str, tuple[list[int], list[float]]]


def greedy_run(variant: Any, weights: str) -> tuple[Engine, Run]:
    """`cpu_decode.MAX_ROWS` greedy requests of 32 tokens on `variant`'s checkpoint with
    `METRALE_CPU_WEIGHTS=weights` (the environment restored after the engine is built): the
    engine and each request's tokens and logprobs."""
    before = os.environ.get("METRALE_CPU_WEIGHTS")
    os.environ["METRALE_CPU_WEIGHTS"] = weights
    try:
        engine = Engine(
            EngineConfig(
                model=str(build(variant)), device="cpu", dtype="float32", num_kv_blocks=200
            )
        )
    finally:
        if before is None:
            os.environ.pop("METRALE_CPU_WEIGHTS")
        else:
            os.environ["METRALE_CPU_WEIGHTS"] = before
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=0, ignore_eos=True)
    for i in range(cpu_decode.MAX_ROWS):
        engine.add_request(f"r{i}", [3 + i, 9, 13 + i, 2, 7 + 2 * i], params)
    got: Run = {}
    while engine.has_unfinished():
        keep_finished(engine.step(), got)
    return engine, got


def keep_finished(outputs: Any, got: Run) -> None:
    """Each finished output's tokens and their logprobs into `got`, by request id."""
    for out in outputs:
        if out.finished:
            c = out.outputs[0]
            lps = [pos[t].logprob for pos, t in zip(c.logprobs or [], c.token_ids)]
            got[out.request_id] = (c.token_ids, lps)


def agreement(first: Run, second: Run) -> list[tuple[str, int, int, list[float]]]:
    """Per request: its id, the tokens before the two runs diverge, its tokens, and the
    logprob differences over the agreeing tokens."""
    rows = []
    for rid, (tokens, lps) in first.items():
        other, other_lps = second[rid]
        same = next((i for i, (a, b) in enumerate(zip(tokens, other)) if a != b), len(tokens))
        diffs = [abs(a - b) for a, b in zip(lps[:same], other_lps[:same])]
        rows.append((rid, same, len(tokens), diffs))
    return rows
