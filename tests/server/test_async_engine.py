"""`AsyncEngine` and the app in-process: cancellation frees KV at the next loop turn, the idle
loop sleeps, add errors reach the caller, a crash of the engine loop ends every stream with
EngineDeadError and turns the server to 503 instead of hanging, and an unexpected exception in
one request is a 500 (or an error frame) that the next request never notices."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metrale import SamplingParams
from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine
from metrale.engine.engine import Engine
from metrale.errors import ContextLengthError, EngineDeadError, InvalidRequestError
from metrale.server.app import create_app
from tests.server.helpers import sse_json

LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture
def engine(checkpoint: Path) -> Iterator[AsyncEngine]:
    config = EngineConfig(
        model=str(checkpoint), device="cpu", num_kv_blocks=64, enable_prefix_caching=False
    )
    async_engine = AsyncEngine(Engine(config))
    async_engine.start()
    try:
        yield async_engine
    finally:
        async_engine.shutdown()


def test_cancelled_consumer_frees_kv_at_the_next_turn(engine: AsyncEngine) -> None:
    core = engine.engine
    total = core.model.num_total_blocks()

    async def run() -> int:
        stream = await engine.add_request("a", "def f(x):", LONG)
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 3:
                break
        stream.abort()
        deadline = time.monotonic() + 2
        while engine.snapshot().num_free_blocks != total or engine.snapshot().num_requests:
            assert time.monotonic() < deadline, engine.snapshot()
            await asyncio.sleep(0.005)
        return engine.snapshot().num_steps

    steps = asyncio.run(run())
    assert steps < 100, "the abort waited for the request to run on"
    assert core.scheduler.stats.aborts == 1

    async def cancelled_task() -> None:
        async def consume() -> None:
            async for _ in engine.generate("b", "def f(x):", LONG):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 2
        while engine.snapshot().num_free_blocks != total or engine.snapshot().num_requests:
            assert time.monotonic() < deadline, engine.snapshot()
            await asyncio.sleep(0.005)

    asyncio.run(cancelled_task())


def test_add_errors_reach_the_caller_and_others_keep_running(engine: AsyncEngine) -> None:
    async def run() -> None:
        good = await engine.add_request("ok", "x", SamplingParams(temperature=0, max_tokens=8))
        with pytest.raises(ContextLengthError):
            await engine.add_request("long", [7] * 600, SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequestError):
            await engine.add_request("ok", "x", SamplingParams(max_tokens=4))  # id in use
        outputs = [o async for o in good]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8

    asyncio.run(run())


def test_idle_loop_sleeps(engine: AsyncEngine) -> None:
    time.sleep(0.2)
    before = os.times()
    time.sleep(1.0)
    after = os.times()
    busy = (after.user - before.user) + (after.system - before.system)
    assert busy < 0.2, f"the idle engine loop used {busy:.2f} s of CPU in 1 s"


def test_engine_crash_fails_streams_and_new_requests(engine: AsyncEngine) -> None:
    core = engine.engine
    real_step = core.step
    calls = 0

    def failing_step() -> Any:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("simulated scheduler bug")
        return real_step()

    core.step = failing_step  # type: ignore[method-assign]
    app = create_app(engine)

    async def run() -> None:
        stream = await engine.add_request("x", "def f(x):", LONG)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("y", "def f(x):", LONG)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            health = await client.get("/health")
            assert health.status_code == 503
            reply = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert reply.status_code == 503
            assert reply.json()["error"]["type"] == "engine_dead"
            assert "retry-after" in reply.headers

    asyncio.run(asyncio.wait_for(run(), 20))
    assert not engine.is_running
    assert not engine.snapshot().alive


def test_unexpected_exception_is_isolated_to_its_request(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(engine)
    tokenizer = engine.engine.tokenizer
    real_render = tokenizer.apply_chat_template

    def render(messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        if messages[-1]["content"] == "boom":
            raise RuntimeError("secret internal detail")
        return real_render(messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", render)
    import metrale.server.routes.openai as routes

    real_logprobs = routes.chat_logprobs_content

    def flaky_logprobs(tok: Any, token_ids: Any, *args: Any) -> Any:
        if len(token_ids) and flaky["armed"]:
            raise ValueError("mid-stream failure")
        return real_logprobs(tok, token_ids, *args)

    flaky = {"armed": False}
    monkeypatch.setattr(routes, "chat_logprobs_content", flaky_logprobs)

    def chat(content: str, **extra: Any) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}

    async def run() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            boom = await client.post("/v1/chat/completions", json=chat("boom"))
            assert boom.status_code == 500
            error = boom.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert "secret" not in boom.text and "Traceback" not in boom.text
            fine = await client.post("/v1/chat/completions", json=chat("hello"))
            assert fine.status_code == 200
            assert fine.json()["usage"]["completion_tokens"] >= 1
            # An error after the stream started: an error frame, then [DONE].
            flaky["armed"] = True
            streamed = await client.post(
                "/v1/chat/completions", json=chat("hello", stream=True, logprobs=True)
            )
            flaky["armed"] = False
            frames = sse_json(streamed.text.splitlines())
            assert frames[-1] == "[DONE]"
            assert isinstance(frames[-2], dict) and "error" in frames[-2]
            assert "mid-stream" not in streamed.text
            again = await client.post("/v1/chat/completions", json=chat("hello", stream=True))
            assert sse_json(again.text.splitlines())[-1] == "[DONE]"

    asyncio.run(asyncio.wait_for(run(), 30))
    deadline = time.monotonic() + 2
    while engine.snapshot().num_requests:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engine.engine.model.num_free_blocks() == engine.engine.model.num_total_blocks()
