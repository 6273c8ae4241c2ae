"""Where a served CPU token goes (issue 26): `metrale serve` on the "small" or "tiny" random
Qwen3 (`profile_cpu_step.py`'s checkpoints), one streaming `/v1/completions` request at a
time, with each process's CPU time and context switches per output token (the HTTP server's
process, the engine process), next to the client's TPOT and the engine's in-process step.

    PYTHONPATH=. .venv/bin/python tools/profile_cpu_serve.py --size tiny [--serve-args "..."]

Why per process: wall times on a shared 2-core machine move with whatever else runs, while
CPU time and switches per token say what each process spends, and whether tokens cost
wakeups (every token is one pipe message to the server and one socket write to the client).
Writes a record under bench/records/ (instrument "profile-cpu-serve").
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_cpu_step import SIZES, checkpoint

from metrale.bench.record import write_record

TICK = os.sysconf("SC_CLK_TCK")


def proc_stats(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, voluntary, involuntary context switches) of a process, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / TICK
    vol = invol = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                invol += int(line.split()[1])
    return cpu, vol, invol


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stream(port: int, prompt: list[int], osl: int) -> tuple[float, list[float]]:
    """One streaming completion: (TTFT seconds, arrival time of each token chunk)."""
    body = {
        "model": "m", "prompt": prompt, "max_tokens": osl, "min_tokens": osl,
        "ignore_eos": True, "temperature": 0, "stream": True,
    }  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    arrivals: list[float] = []
    for line in response:
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            arrivals.append(time.perf_counter())
    conn.close()
    return arrivals[0] - start, arrivals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--serve-args", default="", help="extra `metrale serve` flags")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    # A terminated run still stops its server (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.size, Path(tmp) / args.size)
        env = {**os.environ, "PYTHONPATH": ".", "HF_HUB_OFFLINE": "1"}
        cmd = [args.python, "-m", "metrale.cli", "serve", str(path), "--port", str(port),
               "--served-model-name", "m", "--load-format", "dummy", *args.serve_args.split()]  # fmt: skip
        log = open(Path(tmp) / "server.log", "w")  # noqa: SIM115 - closed below
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            started = time.perf_counter()
            while True:
                try:
                    http.client.HTTPConnection("127.0.0.1", port, timeout=1).request(
                        "GET", "/health"
                    )
                    break
                except OSError:
                    if server.poll() is not None or time.perf_counter() - started > 300:
                        raise SystemExit(f"server did not start: {(Path(tmp) / 'server.log').read_text()[-2000:]}") from None  # fmt: skip
                    time.sleep(0.1)
            ready_s = time.perf_counter() - started
            engine = max(children(server.pid), key=lambda p: proc_stats(p)[0])
            prompts = [
                [6 + (i * 7 + j) % 500 for j in range(args.isl)] for i in range(args.requests + 2)
            ]
            for p in prompts[:2]:  # warm-up
                stream(port, p, args.osl)
            before = {
                name: proc_stats(pid) for name, pid in (("server", server.pid), ("engine", engine))
            }
            ttfts, tpots = [], []
            for p in prompts[2:]:
                ttft, arrivals = stream(port, p, args.osl)
                ttfts.append(ttft)
                tpots.append((arrivals[-1] - arrivals[0]) / max(len(arrivals) - 1, 1))
            after = {
                name: proc_stats(pid) for name, pid in (("server", server.pid), ("engine", engine))
            }
        finally:
            server.terminate()
            server.wait(30)
            log.close()
    tokens = args.requests * args.osl
    per_token = {
        name: {
            "cpu_ms": 1e3 * (after[name][0] - before[name][0]) / tokens,
            "voluntary_switches": (after[name][1] - before[name][1]) / tokens,
            "involuntary_switches": (after[name][2] - before[name][2]) / tokens,
        }
        for name in before
    }  # fmt: skip
    figures: dict[str, Any] = {
        "ready_s": ready_s,
        "ttft_ms_p50": 1e3 * statistics.median(ttfts),
        "ttft_ms_p90": 1e3 * sorted(ttfts)[int(0.9 * (len(ttfts) - 1))],
        "tpot_ms_p50": 1e3 * statistics.median(tpots),
        "per_token": per_token,
        "load_average": os.getloadavg(),
    }
    record = write_record(
        "profile-cpu-serve",
        model_shape=f"qwen3-{args.size}-random",
        config={
            "isl": args.isl,
            "osl": args.osl,
            "requests": args.requests,
            "concurrency": 1,
            "serve_args": args.serve_args,
            "size": SIZES[args.size],
        },
        figures=figures,
        device="cpu",
    )
    print(json.dumps(figures, indent=1))
    print(f"record: {record}")


if __name__ == "__main__":
    main()
