"""Bad input raises a clear error naming the problem and leaves the engine serving the other
requests; every request's blocks return to the pool however it ends."""

from __future__ import annotations

import pytest

from metrale import Engine, EngineConfig, SamplingParams
from metrale.errors import ContextLengthError, InvalidRequestError
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.parity import mixed_prompts

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)


def new_engine(**kwargs: object) -> Engine:
    return Engine(
        EngineConfig(
            model=str(build(VARIANT)), device="cpu", num_kv_blocks=96, max_model_len=256, **kwargs
        )
    )


def run_all(engine: Engine) -> dict[str, list[int]]:
    finals: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    return finals


@pytest.mark.parametrize(
    ("make_params", "param"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_values_name_the_parameter(make_params, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        make_params()
    assert info.value.param == param
    assert param in str(info.value)


def test_bad_requests_leave_others_untouched() -> None:
    prompts = mixed_prompts(4)
    reference = run_all(_with(new_engine(), prompts))
    engine = _with(new_engine(), prompts)
    engine.step()
    engine.step()
    bad = [
        ("empty text", "", InvalidRequestError, "prompt is empty"),
        ("empty ids", [], InvalidRequestError, "prompt is empty"),
        ("too long", list(range(6, 306)), ContextLengthError, "maximum context length"),
        ("out of vocab", [5, 99999], InvalidRequestError, "outside the vocabulary"),
    ]
    for name, prompt, exc, message in bad:
        with pytest.raises(exc, match=message):
            engine.add_request(f"bad-{name}", prompt, GREEDY)
        engine.step()
    with pytest.raises(ContextLengthError, match="max_tokens"):
        engine.add_request("bad-budget", [7, 8, 9], SamplingParams(max_tokens=300))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("r0", [7, 8], GREEDY)
    assert run_all(engine) == reference
    assert_no_leaks(engine)


def _with(engine: Engine, prompts: list[list[int]]) -> Engine:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    return engine


def test_abort_anywhere_frees_blocks_and_spares_the_rest() -> None:
    prompts = mixed_prompts(8)
    reference = run_all(_with(new_engine(), prompts))
    engine = _with(new_engine(max_num_batched_tokens=64, max_num_seqs=8), prompts)
    by_id = engine.scheduler.by_id
    assert by_id["r7"].status.value == "waiting"
    engine.abort_request("r7")
    while not 0 < by_id["r6"].num_computed < by_id["r6"].prompt_len:
        engine.step()
    engine.abort_request("r6")  # mid-prefill (200 tokens at most 64 per step)
    while not by_id["r1"].output_token_ids:
        engine.step()
    engine.abort_request("r1")  # decoding (a fed step of it may be in flight)
    finals = run_all(engine)
    assert set(finals) == {"r0", "r2", "r3", "r4", "r5"}
    assert all(finals[k] == reference[k] for k in finals)
    assert_no_leaks(engine)


def test_timeout_ends_a_request_with_finish_reason_timeout() -> None:
    engine = new_engine()
    engine.add_request(
        "slow", [7, 8, 9], SamplingParams(max_tokens=200, min_tokens=200), timeout=1e-9
    )
    outs = [o for _ in range(3) for o in engine.step()]
    assert outs and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "timeout"
    assert_no_leaks(engine)
