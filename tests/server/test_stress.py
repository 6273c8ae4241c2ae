"""`metrale serve` under load: 64 concurrent streams with a quarter of the clients leaving
mid-stream leave the server healthy, every remaining stream correct and, once all are done,
every KV block free again; SIGTERM during traffic ends every stream cleanly and exits 0 within
10 s."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from metrale import LLM, SamplingParams
from tests.server.helpers import SERVED_NAME, ServerProcess, metric, scrape, sse_json

PROMPTS = [f"# task {i}\ndef step_{i}(x):\n    return" for i in range(8)]
SURVIVOR_TOKENS = 16
LEAVER_TOKENS = 400


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--num-kv-blocks", "800", "--max-num-seqs", "64")
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def _body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def _stream(
    client: httpx.AsyncClient, body: dict[str, Any], leave_after: int | None
) -> list[Any] | None:
    """The SSE frames of one request, or None if this client left after `leave_after` frames."""
    lines: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            lines.append(line)
            frames = sum(1 for x in lines if x.startswith("data:"))
            if leave_after is not None and frames >= leave_after:
                return None  # leaving the block closes the connection mid-stream
    return sse_json(lines)


def _text(frames: list[Any]) -> str:
    return "".join(f["choices"][0]["text"] for f in frames if isinstance(f, dict) and f["choices"])


def test_64_streams_with_disconnects_leave_the_server_healthy(
    server: ServerProcess, reference: LLM
) -> None:
    expected = [
        o.outputs[0].text
        for o in reference.generate(
            PROMPTS,
            SamplingParams(temperature=0, max_tokens=SURVIVOR_TOKENS, ignore_eos=True),
        )
    ]
    before = scrape(server.url)

    async def run() -> list[list[Any] | None]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
            jobs = []
            for i in range(64):
                leaves = i % 4 == 3
                body = _body(PROMPTS[i % 8], LEAVER_TOKENS if leaves else SURVIVOR_TOKENS)
                jobs.append(_stream(client, body, leave_after=2 if leaves else None))
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    finished_at = time.monotonic()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for i, frames in enumerate(results):
        if i % 4 == 3:
            assert frames is None
            continue
        assert frames is not None and frames[-1] == "[DONE]", frames[-3:] if frames else frames
        assert frames[-2]["choices"][0]["finish_reason"] == "length"
        assert _text(frames) == expected[i % 8], i

    # The leavers asked for 400 tokens each; their KV is back long before that would end.
    while True:
        samples = scrape(server.url)
        free = metric(samples, "metrale_kv_blocks_free")
        cached = metric(samples, "metrale_kv_blocks_cached")
        total = metric(samples, "metrale_kv_blocks_total")
        idle = (
            metric(samples, "metrale_num_requests_running") == 0
            and metric(samples, "metrale_num_requests_waiting") == 0
        )
        if idle and free + cached == total:
            break
        assert time.monotonic() - finished_at < 5, (free, cached, total, server.log()[-2000:])
        time.sleep(0.05)
    assert total == 799
    aborted = metric(samples, "metrale_request_finished_total", reason="abort") - metric(
        before, "metrale_request_finished_total", reason="abort"
    )
    assert aborted == 16
    generated = metric(samples, "metrale_generation_tokens_total") - metric(
        before, "metrale_generation_tokens_total"
    )
    assert generated < 48 * SURVIVOR_TOKENS + 16 * LEAVER_TOKENS / 2
    # Still serving correctly afterwards.
    after = httpx.post(
        server.url + "/v1/completions",
        json={**_body(PROMPTS[0], SURVIVOR_TOKENS), "stream": False},
        timeout=30,
    ).json()
    assert after["choices"][0]["text"] == expected[0]


def test_sigterm_during_traffic_exits_0_within_10s(server: ServerProcess) -> None:
    outcomes: list[list[Any] | BaseException] = []

    async def run() -> float:
        started = asyncio.Event()
        first_frames = 0

        async def one(client: httpx.AsyncClient, i: int) -> None:
            nonlocal first_frames
            lines: list[str] = []
            try:
                body = _body(PROMPTS[i % 8], 480)
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        lines.append(line)
                        if (
                            line.startswith("data:")
                            and sum(x.startswith("data:") for x in lines) == 1
                        ):
                            first_frames += 1
                            if first_frames == 24:
                                started.set()
                outcomes.append(sse_json(lines))
            except httpx.HTTPError as exc:
                outcomes.append(exc)

        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            tasks = [asyncio.create_task(one(client, i)) for i in range(24)]
            await asyncio.wait_for(started.wait(), 30)
            server.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            await asyncio.gather(*tasks)
            return sent

    sent = asyncio.run(run())
    rc = server.proc.wait(timeout=15)
    elapsed = time.monotonic() - sent
    assert rc == 0, server.log()[-3000:]
    assert elapsed < 10, elapsed
    assert len(outcomes) == 24
    for frames in outcomes:
        # Every stream ended cleanly: finished, or an error frame; then [DONE].
        assert isinstance(frames, list), frames
        assert frames[-1] == "[DONE]"
        last = frames[-2]
        assert isinstance(last, dict)
        if "error" in last:
            assert last["error"]["message"] and last["error"]["type"]
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in server.log()
