"""Issue 24: a client that disconnects at any point (while sending its body, while queued or
in prefill, while its stream runs) is an INFO line and one `metrale_client_aborts_total{stage}`,
answered 499 in `metrale_requests_total`, never an ERROR or a 500; its KV is freed.

In-process: the app is driven through raw ASGI messages, so each disconnect happens exactly
where the test puts it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrale.engine.async_engine import AsyncEngine
from metrale.server.app import create_app
from tests.server.helpers import running_engine


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[AsyncEngine]:
    with running_engine(checkpoint, num_kv_blocks=64) as handle:
        yield handle


async def call(app: Any, path: str, chunks: list[bytes], leave_after_frames: int) -> list[dict]:
    """POST `chunks` (the last one ends the body unless `leave_after_frames` < 0, which
    leaves while the body is still being sent); the client leaves once it has received
    `leave_after_frames` body frames (0: at once)."""
    inbox: list[dict[str, Any]] = []
    for i, chunk in enumerate(chunks):
        more = i < len(chunks) - 1 or leave_after_frames < 0
        inbox.append({"type": "http.request", "body": chunk, "more_body": more})
    leave = asyncio.Event()
    if leave_after_frames <= 0:
        leave.set()
    sent: list[dict[str, Any]] = []
    frames = 0

    async def receive() -> dict[str, Any]:
        if inbox:
            return inbox.pop(0)
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal frames
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            frames += 1
            if frames >= leave_after_frames:
                leave.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("test", 80),
    }  # fmt: skip
    await asyncio.wait_for(app(scope, receive, send), 30)
    return sent


def samples(app: Any) -> dict[tuple[str, tuple], float]:
    text = app.state.metrale.metrics.exposition().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def aborts(app: Any, stage: str) -> float:
    return samples(app).get(("metrale_client_aborts_total", (("stage", stage),)), 0.0)


def test_disconnects_at_every_stage_are_info_and_counted(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(engine)
    long_body = {"prompt": "def f(x):", "max_tokens": 300, "ignore_eos": True}
    caplog.set_level(logging.INFO)

    async def go() -> None:
        # While sending the body.
        await call(app, "/v1/completions", [b'{"prompt": "def f', b"(x):"], -1)
        assert aborts(app, "body") == 1
        # Queued (non-streaming; the client leaves as soon as the body is sent). The engine
        # takes no step meanwhile, so no first token can race the disconnect into "stream".
        core = engine.engine
        real_step = core.step
        core.step = lambda *args, **kwargs: []  # type: ignore[method-assign]
        for path, body in (
            ("/v1/completions", long_body),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}),
            ("/v1/messages", {"max_tokens": 300, "messages": [{"role": "user", "content": "hi"}]}),
        ):  # fmt: skip
            await call(app, path, [json.dumps(body).encode()], 0)
        core.step = real_step  # type: ignore[method-assign]
        assert aborts(app, "queue") == 3
        # While streaming, after some tokens.
        for path, body in (
            ("/v1/completions", {**long_body, "stream": True}),
            ("/v1/messages", {"max_tokens": 300, "stream": True, "messages": [{"role": "user", "content": "hi"}]}),
        ):  # fmt: skip
            sent = await call(app, path, [json.dumps(body).encode()], 4)
            assert sent[0]["status"] == 200
        assert aborts(app, "stream") == 2

    asyncio.run(go())
    counts = samples(app)
    statuses = {
        labels: v for (name, labels), v in counts.items() if name == "metrale_requests_total"
    }
    assert not any(dict(labels)["status"].startswith("5") for labels in statuses), statuses
    assert sum(v for labels, v in statuses.items() if dict(labels)["status"] == "499") == 4
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert sum("client disconnected" in r.getMessage() for r in caplog.records) == 6
    deadline = time.monotonic() + 5
    while engine.snapshot().num_requests:
        assert time.monotonic() < deadline, "a request outlived its client"
        time.sleep(0.01)
    core = engine.engine
    assert core.model.num_free_blocks() + core.model.cache_only_blocks() == (
        core.model.num_total_blocks()
    )
