"""`metrale bench serve`: a client for any OpenAI-compatible URL that runs a concurrency ladder
(Metrale's instrument): at each rung C every request of the rung is sent at once, ISL tokens of
random ids, OSL tokens out with ignore_eos, streamed; greedy (temperature 0) unless
`--temperature` / `--top-p` / `--top-k` ask for the sampled ladder (issue 23: its rungs are
compared with the greedy ones of the same server).

Owner: bench.

Figures per rung: aggregate output tok/s (usage-reported completion tokens / wall time of the
rung), TTFT and TPOT percentiles (p50/p90/p99; TPOT = (end - first token) / (tokens - 1) per
request) and the number of failed requests. A failed request is counted, never dropped.

The instrument's own cost is a figure too: `client_cpu_s` (the client processes' CPU seconds
over the rung; near the wall time means the client, not the server, set the pace) and, with
`--watch-pids`, each watched process's CPU seconds over the rung (`server_cpu_s`: the HTTP
process and the engine process, from `/proc`). `--client-processes N` splits a rung's
requests over N client processes (each its own event loop and httpx client), started
together once all are ready; at 128 streams one Python client parses ~13k SSE events a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from metrale.bench.record import write_record


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "p50": pick(0.5),
        "p90": pick(0.9),
        "p99": pick(0.99),
        "mean": statistics.fmean(ordered),
    }


def sampling_fields(temperature: float, top_p: float, top_k: int) -> dict[str, Any]:
    """The request's sampling fields: temperature always, top_p / top_k only when they
    filter (so a greedy ladder's requests are what they always were)."""
    fields: dict[str, Any] = {"temperature": temperature}
    if top_p < 1.0:
        fields["top_p"] = top_p
    if top_k > 0:
        fields["top_k"] = top_k
    return fields


async def one_request(
    client: Any, url: str, model: str, prompt: list[int], osl: int, api_key: str | None,
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": osl,
        **(sampling or {"temperature": 0}),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    first: float | None = None
    tokens = 0
    chunks = 0
    try:
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers
        ) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return {"ok": False, "error": f"HTTP {resp.status_code}: {detail}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"ok": False, "error": str(event["error"])[:300]}
                if event.get("choices") and event["choices"][0].get("text"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
                usage = event.get("usage")
                if usage:
                    tokens = int(usage["completion_tokens"])
    except Exception as exc:  # a failed request is a figure, not a crash
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    end = time.perf_counter()
    if first is None or tokens < osl:
        return {"ok": False, "error": f"short response: {tokens} of {osl} tokens"}
    return {
        "ok": True,
        "ttft": first - start,
        "tpot": (end - first) / max(1, tokens - 1),
        "tokens": tokens,
        "chunks": chunks,
    }


async def _send_all(
    url: str, model: str, prompts: list[list[int]], osl: int, api_key: str | None,
    timeout: float, sampling: dict[str, Any] | None, start_at: float | None = None,
) -> tuple[list[dict[str, Any]], float, float, float]:  # fmt: skip
    """Every prompt streamed at once from one httpx client: (results, start, end, client
    CPU seconds). `start_at`: a `time.perf_counter()` moment (CLOCK_MONOTONIC, shared by the
    machine's processes) to wait for before sending."""
    import httpx

    limits = httpx.Limits(
        max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4
    )
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        cpu = time.process_time()
        start = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(client, url, model, p, osl, api_key, sampling) for p in prompts)
        )
        end = time.perf_counter()
        cpu = time.process_time() - cpu
    return list(results), start, end, cpu


def _client_process(
    args: tuple[str, str, list[list[int]], int, str | None, float, dict[str, Any] | None, float],
) -> tuple[list[dict[str, Any]], float, float, float]:
    """One client process of a split rung (`--client-processes`)."""
    url, model, prompts, osl, api_key, timeout, sampling, start_at = args
    return asyncio.run(_send_all(url, model, prompts, osl, api_key, timeout, sampling, start_at))


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used, from /proc; None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_rung(
    url: str, model: str, concurrency: int, isl: int, osl: int, vocab: int, seed: int,
    api_key: str | None, timeout: float, sampling: dict[str, Any] | None = None,
    client_processes: int = 1, watch_pids: list[int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    rng = random.Random(seed)
    prompts = [[rng.randint(10, vocab - 10) for _ in range(isl)] for _ in range(concurrency)]
    watched = {pid: _cpu_seconds(pid) for pid in watch_pids or []}
    parts = min(max(1, client_processes), concurrency)
    if parts == 1:
        results, start, end, client_cpu = await _send_all(
            url, model, prompts, osl, api_key, timeout, sampling
        )
    else:
        import concurrent.futures
        import multiprocessing

        start_at = time.perf_counter() + 1.0 + 0.5 * parts  # each client imports httpx first
        jobs = [
            (url, model, prompts[i::parts], osl, api_key, timeout, sampling, start_at)
            for i in range(parts)
        ]
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(parts, mp_context=context) as pool:
            done = await asyncio.get_running_loop().run_in_executor(
                None, lambda: list(pool.map(_client_process, jobs))
            )
        results = [r for part in done for r in part[0]]
        start = min(part[1] for part in done)
        end = max(part[2] for part in done)
        client_cpu = sum(part[3] for part in done)
    wall = end - start
    server_cpu = {}
    for pid, before in watched.items():
        after = _cpu_seconds(pid)
        if before is not None and after is not None:
            server_cpu[str(pid)] = after - before
    ok = [r for r in results if r["ok"]]
    errors = [r["error"] for r in results if not r["ok"]]
    return {
        "concurrency": concurrency,
        "client_processes": parts,
        "client_cpu_s": client_cpu,
        "server_cpu_s": server_cpu,
        "aggregate_tok_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_ms": {k: 1000 * v for k, v in percentiles([r["ttft"] for r in ok]).items()},
        "tpot_ms": {k: 1000 * v for k, v in percentiles([r["tpot"] for r in ok]).items()},
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": wall,
        "completed": len(ok),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    ladder = [int(c) for c in str(args.concurrency).split(",")]
    sampling = sampling_fields(args.temperature, args.top_p, args.top_k)
    watch_pids = [int(p) for p in args.watch_pids.split(",") if p] if args.watch_pids else []
    rungs = []
    for i, c in enumerate(ladder):
        rung = asyncio.run(
            run_rung(args.url.rstrip("/"), args.model, c, args.isl, args.osl, args.vocab,
                     args.seed + i, args.api_key, args.timeout, sampling,
                     args.client_processes, watch_pids)
        )  # fmt: skip
        rungs.append(rung)
        cpu = " ".join(
            f"{pid}:{sec / rung['wall_s']:.2f}" for pid, sec in rung["server_cpu_s"].items()
        )
        print(
            f"C={c:4d}  {rung['aggregate_tok_s']:9.1f} tok/s  TTFT p50 {rung['ttft_ms']['p50']:8.1f} ms"
            f"  TPOT p50 {rung['tpot_ms']['p50']:7.2f} ms  errors {rung['errors']}"
            f"  client cores {rung['client_cpu_s'] / rung['wall_s']:.2f}"
            + (f"  server cores {cpu}" if cpu else ""),
            flush=True,
        )
    peer = json.loads(Path(args.peer_json).read_text()) if args.peer_json else None
    path = write_record(
        "serve", model_shape=args.shape, figures=rungs, peer_figures=peer, device=args.device,
        config={"url": args.url, "model": args.model, "isl": args.isl, "osl": args.osl,
                "concurrency": ladder, "server": args.server_info, "sampling": sampling,
                "client_processes": args.client_processes},
        out_dir=args.out_dir,
    )  # fmt: skip
    print(f"record: {path}")
    return rungs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8888")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--shape", required=True, help="model shape for the record, e.g. qwen3-8b")
    parser.add_argument("--vocab", type=int, required=True, help="vocabulary size for random ids")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--device", default="auto", help="device the server runs on (record)")
    parser.add_argument("--server-info", default="", help="free text: how the server was started")
    parser.add_argument("--peer-json", default=None, help="peer figures measured in the same run")
    parser.add_argument("--out-dir", default="bench/records")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="split each rung's requests over this many client processes")  # fmt: skip
    parser.add_argument("--watch-pids", default="",
                        help="comma-separated pids whose CPU seconds each rung records "
                             "(the server's HTTP and engine processes)")  # fmt: skip
