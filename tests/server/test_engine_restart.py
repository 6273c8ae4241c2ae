"""Issue 24, fault tolerance: killing the engine process (SIGKILL, by its pid) during requests
gives every in-flight request a clear error at once (an error frame in a stream, a 503 for a
blocking request), `/health` says the engine is down, and the supervisor restarts the engine:
later requests succeed with no restart of the server by hand, counted in
`metrale_engine_restarts_total`."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.helpers import ServerProcess, metric, scrape, sse_json


def engine_pid(server_pid: int) -> int:
    """The engine child of a `metrale serve` process (a multiprocessing spawn child)."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                return int(child)
    raise AssertionError("no engine process found")


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--num-kv-blocks", "96", "--max-num-seqs", "4")
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def test_engine_kill_fails_in_flight_requests_and_the_server_recovers(
    server: ServerProcess,
) -> None:
    long_body = {"prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True}
    first_pid = engine_pid(server.proc.pid)
    blocking: dict[str, Any] = {}

    def send_blocking() -> None:
        blocking["reply"] = httpx.post(server.url + "/v1/completions", json=long_body, timeout=60)

    with httpx.stream(
        "POST", server.url + "/v1/completions", json={**long_body, "stream": True}, timeout=60
    ) as stream:
        lines = stream.iter_lines()
        head = [next(lines), next(lines)]  # generating now
        waiter = threading.Thread(target=send_blocking)
        waiter.start()
        deadline = time.monotonic() + 10
        while metric(scrape(server.url), "metrale_num_requests_running") < 2:
            assert time.monotonic() < deadline, "the blocking request never started"
            time.sleep(0.02)
        os.kill(first_pid, signal.SIGKILL)
        frames = sse_json([*head, *lines])
        # The stream ended with an error frame: the client knows at once.
        health = httpx.get(server.url + "/health", timeout=10)
    assert frames[-1] == "[DONE]"
    error = frames[-2]
    assert isinstance(error, dict) and "error" in error, frames[-3:]
    assert "engine" in error["error"]["message"]
    # Before the new engine is up, /health says why (the restart takes seconds).
    assert health.status_code == 503, health.text
    assert "restarting" in health.json()["error"]["message"]
    waiter.join(30)
    assert blocking["reply"].status_code == 503, blocking["reply"].text
    assert blocking["reply"].headers.get("retry-after")
    # The supervisor brings a new engine up; no restart of the server by hand.
    deadline = time.monotonic() + 90
    while httpx.get(server.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    assert engine_pid(server.proc.pid) != first_pid
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3
    samples = scrape(server.url)
    assert metric(samples, "metrale_engine_restarts_total") == 1
    assert metric(samples, "metrale_engine_alive") == 1
    assert server.proc.poll() is None
