"""The engine process's wire deltas (`DeltaEncoder.encode_state`, straight from the engine's
request state) rebuild, in order, exactly the `RequestOutput`s the engine gives in process
(`RequestState.to_output`) at every step: text, token ids, logprobs, cumulative logprob,
finish and stop reasons, prompt token ids and prompt logprobs, ttft, errors; for several
choices, stop strings, length, aborts and requests arriving mid-run. The wire form is plain
tuples (what the pipe pickles)."""

from __future__ import annotations

import pickle
from typing import Any

from metrale import Engine, EngineConfig, SamplingParams
from metrale.engine.output import RequestState
from metrale.engine.output_delta import Assembly, DeltaEncoder, OutputDelta, apply_delta
from metrale.engine.request import RequestOutput
from tests.helpers.checkpoints import DENSE_VARIANTS, build

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")


class _Stream:
    """Stands in for a `RequestStream`: `apply_delta` only keeps it."""


def _plain(value: Any) -> bool:
    """Whether `value` is built of tuples, lists, dicts and scalars only (no dataclass at the
    top levels the encoder builds)."""
    if isinstance(value, tuple) and type(value) is not tuple:
        return False  # a NamedTuple would pickle through its class
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    return True


def test_deltas_rebuild_the_in_process_outputs() -> None:
    engine = Engine(
        EngineConfig(model=str(build(VARIANT)), device="cpu", dtype="float32", num_kv_blocks=160)
    )
    encoder = DeltaEncoder()
    assemblies: dict[str, Assembly] = {}
    prompts = {
        "plain": ([5, 9, 13, 2, 7], SamplingParams(max_tokens=12, temperature=0)),
        "two-choices-logprobs": (
            [3, 4, 5, 6],
            SamplingParams(n=2, max_tokens=9, temperature=0.8, seed=3, logprobs=2),
        ),
        "prompt-logprobs": (
            [11, 12, 13, 14, 15, 16],
            SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1),
        ),
        "stop-string": ([8, 8, 9], SamplingParams(max_tokens=20, temperature=0, stop=["e"])),
        "aborted": ([21, 22, 23], SamplingParams(max_tokens=30, temperature=0)),
    }
    late = {"late": ([30, 31, 32, 33], SamplingParams(max_tokens=6, temperature=0.5, seed=1))}

    def add(items: dict[str, tuple[list[int], SamplingParams]]) -> None:
        for rid, (ids, params) in items.items():
            engine.add_request(rid, ids, params)
            assemblies[rid] = Assembly(_Stream(), None, list(ids))  # type: ignore[arg-type]

    def both(state: RequestState) -> tuple[RequestOutput, tuple[Any, ...]]:
        return state.to_output(), encoder.encode_state(state)

    add(prompts)
    seen: dict[str, list[RequestOutput]] = {}
    steps = 0
    finished: set[str] = set()
    while engine.has_unfinished():
        steps += 1
        if steps == 3:
            add(late)
        if steps == 5:
            engine.abort_request("aborted")
            encoder.forget("aborted")
        for expected, wire in engine.step_as(both):
            assert _plain(wire)
            wire = pickle.loads(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL))
            delta = OutputDelta.of(wire)
            assert delta.request_id == expected.request_id
            if delta.request_id == "aborted" and steps >= 5:
                continue  # the parent closed that stream when it aborted
            got = apply_delta(assemblies[delta.request_id], delta)
            assert got == expected, (steps, delta.request_id)
            seen.setdefault(delta.request_id, []).append(got)
            if got.finished:
                finished.add(got.request_id)
    assert finished >= {"plain", "two-choices-logprobs", "prompt-logprobs", "stop-string", "late"}
    assert seen["prompt-logprobs"][-1].prompt_logprobs is not None
    assert len(seen["two-choices-logprobs"][-1].outputs) == 2
    assert seen["stop-string"][-1].outputs[0].finish_reason in ("stop", "length")
    # every rebuilt output is its own object: an earlier one never changed afterwards
    plain = seen["plain"]
    assert [len(o.outputs[0].token_ids) for o in plain] == sorted(
        len(o.outputs[0].token_ids) for o in plain
    )
    assert len({id(o.outputs[0].token_ids) for o in plain}) == len(plain)
    assert not encoder._sent, "finished requests' send state is forgotten"
