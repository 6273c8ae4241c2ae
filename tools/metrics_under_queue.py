"""How fast `/metrics` and `/health` answer while thousands of requests wait (issue 24: with
1,872 waiting, `/metrics` once took 7.8 s).

Owner: tools. Starts a real `metrale serve` on a tiny test checkpoint (CPU, 4 running
sequences at most), submits `--requests` long completions at once from one client, and
times `/metrics` and `/health` from another while they wait; writes a record.

Usage: PYTHONPATH=. python tools/metrics_under_queue.py [--requests 2000] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from metrale.bench.record import write_record
from tests.server.helpers import SERVED_NAME, ServerProcess


async def measure(url: str, requests: int, probes: int) -> dict[str, object]:
    limits = httpx.Limits(max_connections=requests + 10, max_keepalive_connections=requests + 10)
    body = {"model": SERVED_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True}
    metrics_ms: list[float] = []
    health_ms: list[float] = []
    waiting: list[float] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as load,
        httpx.AsyncClient(base_url=url, timeout=60) as probe,
    ):
        tasks = [
            asyncio.create_task(load.post("/v1/completions", json=body)) for _ in range(requests)
        ]
        await asyncio.sleep(20)  # every request submitted and queued
        for _ in range(probes):
            start = time.perf_counter()
            text = (await probe.get("/metrics")).text
            metrics_ms.append((time.perf_counter() - start) * 1000)
            line = next(
                x for x in text.splitlines() if x.startswith("metrale_num_requests_waiting")
            )
            waiting.append(float(line.split()[-1]))
            start = time.perf_counter()
            await probe.get("/health")
            health_ms.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(0.5)
        for task in tasks:
            task.cancel()
    return {
        "waiting_at_probes": waiting,
        "metrics_ms": metrics_ms,
        "metrics_ms_max": max(metrics_ms),
        "metrics_ms_median": statistics.median(metrics_ms),
        "health_ms_max": max(health_ms),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--probes", type=int, default=10)
    ap.add_argument("--out-dir", default="bench/records")
    args = ap.parse_args()
    server = ServerProcess("--max-num-seqs", "4", "--max-queue", str(args.requests + 100))
    try:
        server.wait_ready()
        figures = asyncio.run(measure(server.url, args.requests, args.probes))
    finally:
        server.stop()
    print(figures)
    path = write_record(
        "metrics-under-queue",
        model_shape="tiny-qwen3",
        config={"requests": args.requests, "probes": args.probes, "max_num_seqs": 4},
        figures=figures,
        device="cpu",
        out_dir=args.out_dir,
        notes="/metrics and /health timed from a second client while the requests wait",
    )
    print(f"record: {path}")


if __name__ == "__main__":
    main()
