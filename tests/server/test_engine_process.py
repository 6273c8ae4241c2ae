"""`EngineProcess`: the engine in a child process gives exactly the outputs of the engine in
this process (cumulative text, tokens, logprobs, n > 1, stop strings), add errors reach the
caller while the others run on, an abort frees the request's KV, and a child that dies ends
every open stream with EngineDeadError and turns the server to 503 instead of hanging; the
wire carries `speculative` and `lookup_tenant` to `Engine.add_request`."""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metrale import SamplingParams
from metrale.config import EngineConfig
from metrale.engine.engine import DEFAULT_TENANT, Engine
from metrale.engine.engine_process import EngineProcess, _ChildLoop
from metrale.engine.handle import AddArgs
from metrale.engine.request import RequestOutput
from metrale.errors import ContextLengthError, EngineDeadError
from metrale.server.app import create_app

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
CASES = [
    ("a", "def f(x):", SamplingParams(temperature=0, max_tokens=24, logprobs=2)),
    ("b", "import os\n", SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=16)),
    ("c", "class A:", SamplingParams(temperature=0, max_tokens=40, stop=["\n\n", "):"])),
    ("d", [5, 9, 11, 3], SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1)),
]


def _config(checkpoint: Path) -> EngineConfig:
    return EngineConfig(
        model=str(checkpoint), device="cpu", num_kv_blocks=64, enable_prefix_caching=False
    )


@pytest.fixture(scope="module")
def process(checkpoint: Path) -> Iterator[EngineProcess]:
    handle = EngineProcess(_config(checkpoint))
    handle.start()
    try:
        yield handle
    finally:
        handle.shutdown()


def _entries(positions: list | None) -> list | None:
    """Logprob positions as (token, rank, decoded) without the values: the two engines may
    batch a request with different neighbours (requests reach the process at their own
    times), and float32 reductions over different batch shapes differ in the last bits.
    `_values` carries the values, compared with a tolerance."""
    if positions is None:
        return None
    return [
        None if p is None else sorted((t, lp.rank, lp.decoded_token) for t, lp in p.items())
        for p in positions
    ]


def _values(output: RequestOutput) -> list[float]:
    positions = [output.prompt_logprobs or []] + [c.logprobs or [] for c in output.outputs]
    return [
        lp.logprob for ps in positions for p in ps if p is not None for _, lp in sorted(p.items())
    ]


def _fingerprint(output: RequestOutput) -> list[object]:
    return [
        output.finished,
        output.prompt_token_ids,
        _entries(output.prompt_logprobs),
        [
            (c.index, c.text, c.token_ids, _entries(c.logprobs), c.finish_reason, c.stop_reason)
            for c in output.outputs
        ],
    ]


def test_outputs_equal_the_in_process_engine(process: EngineProcess, checkpoint: Path) -> None:
    engine = Engine(_config(checkpoint))
    expected = {}
    expected_values: dict[str, list[float]] = {}
    for rid, prompt, params in CASES:
        if isinstance(prompt, str):
            engine.add_request(rid, prompt, params)
        else:
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                expected[out.request_id] = _fingerprint(out)
                expected_values[out.request_id] = _values(out)

    async def run() -> dict[str, list[RequestOutput]]:
        async def one(rid: str, prompt: str | list[int], params: SamplingParams) -> list:
            text = prompt if isinstance(prompt, str) else None
            ids = None if isinstance(prompt, str) else prompt
            stream = await process.add_request(rid, text, params, prompt_token_ids=ids)
            return [out async for out in stream]

        results = await asyncio.gather(*(one(*case) for case in CASES))
        return {case[0]: outs for case, outs in zip(CASES, results)}

    got = asyncio.run(asyncio.wait_for(run(), 60))
    for rid, outputs in got.items():
        assert _fingerprint(outputs[-1]) == expected[rid], rid
        assert _values(outputs[-1]) == pytest.approx(expected_values[rid], abs=1e-5), rid
        # Cumulative: every output extends the one before, and none changed after it was handed out.
        for before, after in itertools.pairwise(outputs):
            for b, a in zip(before.outputs, after.outputs):
                assert a.text.startswith(b.text) and a.token_ids[: len(b.token_ids)] == b.token_ids


def test_add_errors_reach_the_caller_and_abort_frees_kv(process: EngineProcess) -> None:
    total = process.info.num_total_blocks

    async def run() -> None:
        stream = await process.add_request("long", "def f(x):", LONG)
        with pytest.raises(ContextLengthError):
            await process.add_request("bad", "x", SamplingParams(max_tokens=10**6))
        first = await stream.__anext__()
        assert first.outputs[0].token_ids
        stream.abort()
        deadline = time.monotonic() + 5
        while process.snapshot().num_free_blocks != total or process.snapshot().num_requests:
            assert time.monotonic() < deadline, process.snapshot()
            await asyncio.sleep(0.01)
        again = await process.add_request("after", "def g():", SamplingParams(max_tokens=4))
        outs = [o async for o in again]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        assert process.num_open_requests() == 0

    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_dead_child_fails_streams_and_new_requests(checkpoint: Path) -> None:
    handle = EngineProcess(_config(checkpoint))
    handle.start()
    app = create_app(handle)

    async def run() -> None:
        stream = await handle.add_request("x", "def f(x):", LONG)
        await stream.__anext__()
        os.kill(handle._process.pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await handle.add_request("y", "def f(x):", LONG)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 503
            reply = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert reply.status_code == 503
            assert reply.json()["error"]["type"] == "engine_dead"

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
        assert not handle.is_running
        assert not handle.snapshot().alive
    finally:
        handle.shutdown(timeout=2)


def test_a_model_that_cannot_load_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    with pytest.raises(Exception, match="NoSuchModel"):
        EngineProcess(EngineConfig(model=str(tmp_path), device="cpu"))


def test_the_wire_carries_speculative_and_lookup_tenant(process: EngineProcess) -> None:
    """The parent's "add" tuple holds them, the cache namespace, the priority and the session (defaults included), the real child
    accepts it, and the child's side of the wire hands them to `Engine.add_request`."""
    sent: list[tuple[Any, ...]] = []
    real_send = process._send

    def record(message: tuple[Any, ...]) -> None:
        sent.append(message)
        real_send(message)

    async def run() -> None:
        for rid, kwargs in [
            (
                "w1",
                {
                    "speculative": False,
                    "lookup_tenant": "key:ab/t",
                    "cache_namespace": "s",
                    "session_id": "chat-1",
                    "priority": 3,
                },
            ),
            ("w2", {}),
        ]:
            stream = await process.add_request(
                rid, "def f(x):", SamplingParams(max_tokens=2), **kwargs
            )
            outs = [o async for o in stream]
            assert outs[-1].finished and not outs[-1].error

    process._send = record  # type: ignore[method-assign]
    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        del process._send
    adds = [pickle.loads(pickle.dumps(m)) for m in sent if m[0] == "add"]
    wired = [AddArgs.from_wire(a) for a in adds]  # by field name: the tuple grows at its end
    got = [
        (a.speculative, a.lookup_tenant, a.cache_namespace, a.priority, a.session_id) for a in wired
    ]
    assert got == [(False, "key:ab/t", "s", 3, "chat-1"), (True, DEFAULT_TENANT, None, 0, None)]

    calls: list[dict[str, Any]] = []

    class SpyEngine:
        def add_request(self, *args: Any, **kwargs: Any) -> None:
            calls.append(kwargs)

    class Pipe:
        def __init__(self) -> None:
            self.sent: list[tuple[Any, ...]] = []

        def send(self, message: tuple[Any, ...]) -> None:
            self.sent.append(message)

    pipe = Pipe()
    child = _ChildLoop(SpyEngine(), pipe)  # type: ignore[arg-type]
    for add in adds:
        assert child._apply(add)
    assert [
        (c["speculative"], c["lookup_tenant"], c["cache_namespace"], c["priority"], c["session_id"])
        for c in calls
    ] == [(False, "key:ab/t", "s", 3, "chat-1"), (True, DEFAULT_TENANT, None, 0, None)]
    assert pipe.sent == [("added", "w1", None), ("added", "w2", None)]
    # The child's snapshots carry the speculation counters (zero: speculation is off here).
    snap = process.snapshot()
    assert snap.spec.num_drafts == 0 and snap.num_speculative_tokens == 0
