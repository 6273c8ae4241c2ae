"""Issue 24, input hardening: every input that used to be a 500 is a 4xx naming the problem
(deep nesting, huge integers, lone surrogates in any text or in `model`, NaN); error answers
always encode; the prompt limit refuses a huge text before it is tokenized; and a big body or
prompt is decoded / tokenized off the event loop, so `/health` and a small completion are
answered while it is still being processed (proved by the order of events, not a timer).

In-process (`AsyncEngine` + the app over httpx's ASGI transport): no server subprocess."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import metrale.server.state as state_module
from metrale.engine.async_engine import AsyncEngine
from metrale.errors import NotFoundError
from metrale.server.app import create_app
from metrale.server.errors import error_response
from metrale.server.routes.common import OFFLOAD_MIN_CHARS
from tests.server.helpers import running_engine

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[AsyncEngine]:
    with running_engine(checkpoint, num_kv_blocks=64) as handle:
        yield handle


def client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def _raw(text: str) -> bytes:
    return text.encode()


SURROGATE = '"\\ud800"'
BAD_BODIES = [
    # (path, raw body, expected param or None, words the message must hold)
    ("/v1/completions", _raw('{"prompt": "x", "n": ' + "[" * 1000 + "]" * 1000 + "}"), None, "deep"),
    ("/v1/completions", _raw('{"prompt": "x", "logit_bias": ' + '{"a": ' * 80 + "1" + "}" * 80 + "}"), "logit_bias", "deep"),
    ("/v1/completions", _raw('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}"), "max_tokens", "digits"),
    ("/v1/completions", _raw('{"prompt": "x", "n": ' + "9" * 4301 + "}"), "n", "digits"),
    ("/v1/completions", _raw('{"prompt": "x", "seed": -' + "9" * 30 + "}"), "seed", "digits"),
    ("/v1/completions", _raw('{"prompt": "x", "temperature": NaN}'), None, "NaN"),
    ("/v1/completions", _raw('{"prompt": ' + SURROGATE + "}"), "prompt", "surrogate"),
    ("/v1/completions", _raw('{"prompt": ["ok", "a\\udfff"]}'), "prompt[1]", "surrogate"),
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "prompt", "surrogate"),
    ("/v1/completions", _raw('{"prompt": "x", "stop": [' + SURROGATE + "]}"), "stop[0]", "surrogate"),
    ("/v1/completions", _raw('{"prompt": "x", "model": ' + SURROGATE + "}"), "model", "surrogate"),
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": ' + SURROGATE + "}]}"), "messages[0].content", "surrogate"),
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": [{"type": "text", "text": ' + SURROGATE + "}]}]}"), "messages[0].content[0].text", "surrogate"),
    ("/v1/chat/completions", _raw('{"messages": [{"role": "user", "content": "x"}], "model": ' + SURROGATE + "}"), "model", "surrogate"),
    ("/v1/messages", _raw('{"max_tokens": 2, "messages": [{"role": "user", "content": ' + SURROGATE + "}]}"), "messages[0].content", "surrogate"),
    ("/v1/messages", _raw('{"max_tokens": 2, "system": ' + SURROGATE + ', "messages": [{"role": "user", "content": "x"}]}'), "system", "surrogate"),
    ("/v1/messages", _raw('{"max_tokens": 2, "model": ' + SURROGATE + ', "messages": [{"role": "user", "content": "x"}]}'), "model", "surrogate"),
    ("/v1/messages", _raw('{"max_tokens": ' + "1" * 5000 + ', "messages": [{"role": "user", "content": "x"}]}'), "max_tokens", "digits"),
]  # fmt: skip


def test_inputs_that_were_500_are_4xx_naming_the_problem(engine: AsyncEngine) -> None:
    app = create_app(engine)

    async def go() -> None:
        async with client(app) as c:
            for path, raw, param, words in BAD_BODIES:
                reply = await c.post(
                    path, content=raw, headers={"content-type": "application/json"}
                )
                assert reply.status_code == 400, (path, raw[:80], reply.text)
                body = reply.json()
                error = body["error"]
                if path == "/v1/messages":
                    assert body["type"] == "error"
                assert error["param"] == param, (raw[:80], error)
                assert words in error["message"], error
                reply.content.decode("utf-8")  # the answer itself is valid UTF-8
            # The server is fine afterwards.
            ok = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200, ok.text

    run(go())


def test_error_answers_always_encode_and_never_echo_a_huge_value(engine: AsyncEngine) -> None:
    # A surrogate reaching an error message (e.g. a 404 for such a model) cannot break it.
    reply = error_response(NotFoundError("the model '\ud800' does not exist", param="\udc00"))
    body = json.loads(reply.body)
    assert body["error"]["message"] == "the model '\ufffd' does not exist"
    app = create_app(engine)

    async def go() -> None:
        async with client(app) as c:
            huge = "m" * 100_000
            reply = await c.post("/v1/completions", json={"prompt": "x", "model": huge})
            assert reply.status_code == 404
            assert len(reply.text) < 2000
            reply = await c.get("/v1/models/" + huge[:60_000])
            assert reply.status_code == 404 and len(reply.text) < 2000
            reply = await c.get("/v1/models/%ED%A0%80")
            assert reply.status_code == 404

    run(go())


def test_prompt_limit_refuses_a_huge_text_before_tokenizing(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(engine, max_prompt_tokens=8)
    tokenizer = engine.tokenizer
    encoded: list[int] = []
    real_encode = tokenizer.encode

    def encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        encoded.append(len(text))
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)

    async def go() -> None:
        async with client(app) as c:
            big = "word " * 20_000
            for path, body, param in (
                ("/v1/completions", {"prompt": big}, "prompt"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages"),
                ("/v1/messages", {"max_tokens": 2, "system": big, "messages": USER}, "messages"),
            ):  # fmt: skip
                reply = await c.post(path, json=body)
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["code"] == "context_length_exceeded" and error["param"] == param
            assert all(n < 1000 for n in encoded), "a huge prompt was tokenized"
            # Past the limit after tokenizing (a short text of many tokens), and token ids.
            reply = await c.post("/v1/completions", json={"prompt": "a b c d e f g h i j k l"})
            assert reply.json()["error"]["code"] == "context_length_exceeded"
            reply = await c.post("/v1/completions", json={"prompt": list(range(10, 30))})
            assert "--max-prompt-tokens" in reply.json()["error"]["message"]
            reply = await c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
            assert reply.status_code == 200

    run(go())


def _ordering(
    app: Any, big: dict[str, Any], path: str, started: threading.Event, gate: threading.Event
) -> list[str]:
    """Send `big`; once its processing has `started`, `/health` and a small completion, while
    `big` is held (by `gate`, set once both answered); the order in which the three finished."""
    order: list[str] = []

    async def go() -> None:
        async with client(app) as c:

            async def send_big() -> None:
                reply = await c.post(path, json=big)
                assert 200 <= reply.status_code < 500, reply.text
                order.append("big")

            async def send_small() -> None:
                while not started.is_set():
                    await asyncio.sleep(0.005)
                health = await c.get("/health")
                assert health.status_code == 200
                order.append("health")
                small = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert small.status_code == 200, small.text
                order.append("small")
                gate.set()

            await asyncio.gather(send_big(), send_small())

    run(go())
    return order


def test_health_and_small_request_answered_while_a_20mib_body_is_processed(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The 20 MiB prompt's decoding waits (on a worker thread) until /health and a small
    completion have been answered: were it on the event loop, they could not be."""
    started, gate = threading.Event(), threading.Event()
    real_decode = state_module.decode_json

    def slow_decode(raw: bytes) -> Any:
        if len(raw) > 2**20:
            started.set()
            assert gate.wait(30), "the event loop was blocked by the big body"
        return real_decode(raw)

    monkeypatch.setattr(state_module, "decode_json", slow_decode)
    big = {"prompt": "def f(x):\n    return x\n" * (20 * 2**20 // 24), "max_tokens": 2}
    order = _ordering(create_app(engine), big, "/v1/completions", started, gate)
    assert order == ["health", "small", "big"]


def test_long_prompt_is_templated_and_tokenized_off_the_loop(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, gate = threading.Event(), threading.Event()
    tokenizer = engine.tokenizer
    real_encode = tokenizer.encode

    def slow_encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        if len(text) >= OFFLOAD_MIN_CHARS:
            started.set()
            assert gate.wait(30), "the event loop was blocked by tokenizing"
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    text = "x = 1\n" * (OFFLOAD_MIN_CHARS // 6 + 1)  # over the context: refused after
    big = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    order = _ordering(create_app(engine), big, "/v1/chat/completions", started, gate)
    assert order == ["health", "small", "big"]
