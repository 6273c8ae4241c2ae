"""`metrale bench serve`'s client against a stub OpenAI streaming server: one process or a rung
split over several client processes gives the same counts, and the instrument's own CPU
(client and watched processes) is recorded."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from metrale.bench.serve import run_rung

starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")


def _app() -> object:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        count = int(body["max_tokens"])

        async def events() -> AsyncIterator[str]:
            for i in range(count):
                chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                await asyncio.sleep(0)
            usage = {"choices": [], "usage": {"completion_tokens": count}}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "the stub server did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("processes", [1, 2])
def test_rung_counts_and_instrument_cpu(stub_url: str, processes: int) -> None:
    rung = asyncio.run(
        run_rung(stub_url, "m", 6, 4, 9, 100, 0, None, 60.0, None,
                 client_processes=processes, watch_pids=[os.getpid()])
    )  # fmt: skip
    assert rung["errors"] == 0, rung["error_samples"]
    assert rung["completed"] == 6
    assert rung["client_processes"] == processes
    assert rung["aggregate_tok_s"] == pytest.approx(6 * 9 / rung["wall_s"])
    assert rung["client_cpu_s"] > 0
    # the stub server runs in this process: the watched pid did the serving's work
    assert rung["server_cpu_s"][str(os.getpid())] > 0
