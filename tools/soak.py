"""Soak (issue 24): `metrale serve` on the bundled model, on the CPU, driven at saturation for a
fixed time under faults, then checked for 5xx, leaked KV blocks, RSS growth and KAT drift.

Usage: `make soak` (DURATION=600 by default), or
    PYTHONPATH=. python tools/soak.py --duration 600 --clients 16 [--out-dir bench/records]

What it does:
- Starts `metrale serve metrale/assets/tiny-code --device cpu --port 0
  --restart-engine-on-failure` in its own process (the engine in its own child process, the
  default), its log in a temporary file, and waits for `/health`.
- Warm-up, then a KAT set: 8 fixed greedy requests (completions, chat, messages) whose texts
  are kept. Then the RSS of the server and engine processes (the baseline).
- `--clients` concurrent clients send requests back to back until `--duration` has passed:
  a mix of `/v1/completions`, `/v1/chat/completions` and `/v1/messages`, streamed or not, with
  random `n`, `logprobs`, stops, seeds, temperatures and lengths; 10% are streams the client
  closes at a random point; 5% are malformed (bad JSON, wrong types, deep nesting, huge
  integers, lone surrogates) and must get a 4xx.
- At `--kill-at` seconds (default: half the duration) the engine process gets SIGKILL. The
  kill window runs from the kill until `/health` is 200 again, plus `KILL_GRACE_S`; a request
  whose life overlaps it may fail (503, or an error frame in a stream) without failing the soak.
- After the load: waits for no running or waiting requests, idles, reads `/metrics`
  (free + prefix-cache-only blocks against total: the difference is leaked), sends the KAT set
  again, and reads the RSS again.
- Writes a record (`instrument: soak`, device cpu) with the counts by outcome, p50/p99
  latency, leaked blocks, RSS, KAT equality, server-log ERROR/Traceback counts, and a verdict
  per criterion; exits 1 when any criterion fails.

Owner: tools (reliability).

Invariants:
- The server is always stopped (SIGTERM, then SIGKILL) when the soak ends, even on error.
- A 5xx or stream error outside the kill window, a malformed request answered other than 4xx,
  a leaked block, RSS growth of 10% or more, or any KAT difference fails the soak.
- The RSS baseline is taken after the warm-up and the first KAT pass; the engine measured at
  the end is the restarted one, so the engine's RSS just before the kill is recorded too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from metrale.bench.record import write_record  # noqa: E402

BUNDLED_MODEL = REPO_ROOT / "metrale" / "assets" / "tiny-code"
KILL_GRACE_S = 2.0
DISCONNECT_FRACTION = 0.10
MALFORMED_FRACTION = 0.05
RSS_GROWTH_LIMIT_PCT = 10.0
_ADDRESS = re.compile(r"(http://127\.0\.0\.1:\d+)")

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\ndef list_files(path):",
    "class Stack:\n    def __init__(self):",
    "# Sort a list of integers\ndef sort_numbers(xs):",
    "for i in range(10):",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "while True:\n    line = input()",
    "def add(a, b):\n    return",
]
STOPS = ["\n\n", "return", ")", ":", "def ", "\n#"]

# Greedy, fixed requests: their texts must not change across the soak (the engine restart
# included). Greedy output depends only on the prompt, so batching does not matter.
KAT = (
    [("/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0}) for p in PROMPTS[:4]]
    + [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0},
        )
        for p in PROMPTS[4:6]
    ]
    + [
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0},
        )
        for p in PROMPTS[6:8]
    ]
)


# -- processes ------------------------------------------------------------------------------


def engine_pid(server_pid: int) -> int | None:
    """The engine child of a `metrale serve` process (a multiprocessing spawn child)."""
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{server_pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    with contextlib.suppress(OSError):
                        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                            return int(child)
    return None


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_pair(server_pid: int) -> dict[str, Any]:
    epid = engine_pid(server_pid)
    server, engine = rss_mb(server_pid), rss_mb(epid)
    total = (server or 0.0) + (engine or 0.0)
    return {"server_mb": server, "engine_mb": engine, "engine_pid": epid, "total_mb": total}


class Server:
    def __init__(self, model: Path, extra: list[str]) -> None:
        fd, name = tempfile.mkstemp(prefix="metrale-soak-", suffix=".log")
        self.log_path = Path(name)
        self._log = os.fdopen(fd, "wb")
        args = [
            sys.executable, "-m", "metrale.cli", "serve", str(model), "--device", "cpu",
            "--port", "0", "--restart-engine-on-failure", *extra,
        ]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        env.pop("METRALE_API_KEY", None)
        self.proc = subprocess.Popen(
            args, cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.url = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"metrale serve exited with {self.proc.returncode}:\n{self.log()}")  # fmt: skip
            if not self.url and (found := _ADDRESS.search(self.log())):
                self.url = found.group(1)
            if self.url:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
            time.sleep(0.2)
        raise RuntimeError(f"metrale serve did not become healthy:\n{self.log()[-3000:]}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


# -- metrics --------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """Unlabelled samples of `/metrics` (name -> value)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = float(parts[1])
    return out


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# -- requests -------------------------------------------------------------------------------


def kat_text(path: str, body: dict[str, Any]) -> str:
    if path == "/v1/messages":
        return "".join(b.get("text", "") for b in body["content"])
    if path == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    return body["choices"][0]["text"]


def run_kat(url: str, model: str) -> list[str]:
    out = []
    with httpx.Client(timeout=120) as client:
        for path, body in KAT:
            reply = client.post(url + path, json={"model": model, **body})
            reply.raise_for_status()
            out.append(kat_text(path, reply.json()))
    return out


def random_body(rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/messages"])
    prompt = rng.choice(PROMPTS) + (" " + rng.choice(PROMPTS)) * rng.randint(0, 3)
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice([1, 4, 16, 32, 64, 128])}
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0, 0.7, 1.0])
    if rng.random() < 0.3:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if path == "/v1/messages":
        body["messages"] = [{"role": "user", "content": prompt}]
        if "stop" in body:
            body["stop_sequences"] = body.pop("stop")
        return path, body
    if rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.4:
        body["n"] = rng.randint(2, 4)
    if path == "/v1/completions":
        body["prompt"] = prompt
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
    return path, body


def malformed(rng: random.Random, model: str) -> tuple[str, str, bytes]:
    """(kind, path, raw body) of a request that must get a 4xx."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/messages"])
    key = "prompt" if path == "/v1/completions" else "messages"
    good = json.dumps("hi") if key == "prompt" else json.dumps([{"role": "user", "content": "hi"}])
    kinds = {
        "bad_json": b'{"model": "m", "' + key.encode() + b'": [',
        "wrong_type": json.dumps({"model": model, key: 5, "max_tokens": "ten"}).encode(),
        "deep_nesting": (
            '{"model": "m", "max_tokens": 4, "' + key + '": ' + "[" * 5000 + "]" * 5000 + "}"
        ).encode(),
        "huge_int": (
            '{"model": "'
            + model
            + '", "'
            + key
            + '": '
            + good
            + ', "max_tokens": '
            + "9" * 5000
            + "}"
        ).encode(),
        "lone_surrogate_prompt": (
            '{"model": "'
            + model
            + '", "max_tokens": 4, "'
            + key
            + '": '
            + (r'"a\ud800b"' if key == "prompt" else r'[{"role": "user", "content": "a\ud800b"}]')
            + "}"
        ).encode(),
        "lone_surrogate_model": (
            r'{"model": "x\udc00", "max_tokens": 4, "' + key + '": ' + good + "}"
        ).encode(),
        "negative_n": json.dumps(
            {"model": model, key: json.loads(good), "max_tokens": -3}
        ).encode(),
    }
    kind = rng.choice(sorted(kinds))
    return kind, path, kinds[kind]


class Soak:
    def __init__(self, url: str, model: str, args: argparse.Namespace) -> None:
        self.url = url
        self.model = model
        self.args = args
        self.results: list[dict[str, Any]] = []
        self.kill_t: float | None = None
        self.recovered_t: float | None = None
        self.engine_rss_before_kill: float | None = None
        self.killed_pid: int | None = None

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        start = time.monotonic()
        rec: dict[str, Any] = {"start": start}
        roll = rng.random()
        try:
            if roll < MALFORMED_FRACTION:
                kind, path, raw = malformed(rng, self.model)
                rec.update(kind="malformed", variant=kind, path=path)
                reply = await client.post(
                    self.url + path, content=raw, headers={"content-type": "application/json"}
                )
                rec["status"] = reply.status_code
            else:
                path, body = random_body(rng, self.model)
                disconnect = roll < MALFORMED_FRACTION + DISCONNECT_FRACTION
                stream = disconnect or rng.random() < 0.5
                rec.update(kind="disconnect" if disconnect else "normal", path=path, stream=stream)
                if stream:
                    body["stream"] = True
                    if disconnect:
                        body["max_tokens"] = max(body["max_tokens"], 64)
                    cut = rng.randint(0, 20) if disconnect else None
                    async with client.stream("POST", self.url + path, json=body) as reply:
                        rec["status"] = reply.status_code
                        rec["retry_after"] = reply.headers.get("retry-after")
                        lines = 0
                        async for line in reply.aiter_lines():
                            if cut is not None and lines >= cut:
                                rec["closed_early"] = True
                                break
                            lines += 1
                            if line.startswith("event: error") or (
                                line.startswith("data: {") and '"error"' in line[:40]
                            ):
                                rec["stream_error"] = line[:300]
                else:
                    reply = await client.post(self.url + path, json=body)
                    rec["status"] = reply.status_code
                    rec["retry_after"] = reply.headers.get("retry-after")
                    if reply.status_code >= 400:
                        rec["error_body"] = reply.text[:300]
        except httpx.HTTPError as exc:
            rec["exception"] = f"{type(exc).__name__}: {exc}"[:300]
        rec["end"] = time.monotonic()
        self.results.append(rec)
        if rec.get("status") == 503 or "exception" in rec:
            # As a real client would (and so the kill window is not thousands of instant 503s):
            # wait as `retry-after` says, at most a second.
            await asyncio.sleep(min(1.0, max(0.1, float(rec.get("retry_after") or 0.5))))

    async def client_loop(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            while time.monotonic() < deadline:
                await self.one(client, rng)

    async def killer(self, start: float, server_pid: int) -> None:
        await asyncio.sleep(max(0.0, start + self.args.kill_at - time.monotonic()))
        pid = engine_pid(server_pid)
        if pid is None:
            print("soak: no engine process to kill", file=sys.stderr)
            return
        self.engine_rss_before_kill = rss_mb(pid)
        self.killed_pid = pid
        os.kill(pid, signal.SIGKILL)
        self.kill_t = time.monotonic()
        print(f"soak: killed engine pid {pid} at {self.kill_t - start:.1f}s", flush=True)
        async with httpx.AsyncClient(timeout=10) as client:
            await asyncio.sleep(0.2)
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        break
                await asyncio.sleep(0.2)
        self.recovered_t = time.monotonic()
        print(f"soak: healthy again after {self.recovered_t - self.kill_t:.1f}s", flush=True)

    async def run(self, server_pid: int) -> float:
        start = time.monotonic()
        deadline = start + self.args.duration
        kill = asyncio.create_task(self.killer(start, server_pid))
        await asyncio.gather(*(self.client_loop(i, deadline) for i in range(self.args.clients)))
        await kill
        return time.monotonic() - start

    def in_kill_window(self, rec: dict[str, Any]) -> bool:
        if self.kill_t is None:
            return False
        end = (self.recovered_t or float("inf")) + KILL_GRACE_S
        return rec["start"] <= end and rec["end"] >= self.kill_t

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        bad: list[dict[str, Any]] = []
        latencies: list[float] = []

        def bump(key: str) -> None:
            counts[key] = counts.get(key, 0) + 1

        for rec in self.results:
            window = self.in_kill_window(rec)
            status = rec.get("status")
            if rec["kind"] == "malformed":
                bump(f"malformed_{status if status is not None else 'exception'}")
                if status is None or not 400 <= status < 500:
                    bad.append(rec)
                continue
            if rec["kind"] == "disconnect" and rec.get("closed_early"):
                bump("client_disconnect")
                continue
            if "exception" in rec:
                bump("kill_window_exception" if window else "exception")
                if not window:
                    bad.append(rec)
                continue
            if status is not None and status >= 500:
                bump(f"kill_window_{status}" if window else str(status))
                if not window:
                    bad.append(rec)
                continue
            if "stream_error" in rec:
                bump("kill_window_stream_error" if window else "stream_error")
                if not window:
                    bad.append(rec)
                continue
            if status is not None and 400 <= status < 500:
                bump(str(status))
                bad.append(rec)  # a well-formed request should not be refused
                continue
            bump("2xx" if status is not None and status < 300 else str(status))
            latencies.append(rec["end"] - rec["start"])
        return {
            "total_requests": len(self.results),
            "by_outcome": dict(sorted(counts.items())),
            "kill_window_requests": sum(self.in_kill_window(r) for r in self.results),
            "latency_s": {
                "p50": percentile(latencies, 50),
                "p99": percentile(latencies, 99),
                "mean": statistics.fmean(latencies) if latencies else None,
                "count": len(latencies),
            },
            "unexpected": [{k: v for k, v in r.items() if k not in ("start", "end")} for r in bad],
        }


def drain(url: str, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = scrape(url)
        busy = m.get("metrale_num_requests_running", 0) + m.get("metrale_num_requests_waiting", 0)
        if busy == 0:
            break
        time.sleep(0.5)
    time.sleep(3.0)  # a short idle: anything still held now is a leak
    return scrape(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients")
    parser.add_argument("--kill-at", type=float, default=None, help="seconds (default: half)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=str(BUNDLED_MODEL))
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "bench" / "records"))
    parser.add_argument("--serve-arg", action="append", default=[], help="extra serve flag")
    args = parser.parse_args(argv)
    if args.kill_at is None:
        args.kill_at = args.duration / 2

    server = Server(Path(args.model), args.serve_arg)
    try:
        server.wait_ready()
        url = server.url
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"soak: {url} serving {model}; warm-up", flush=True)
        warm = Soak(url, model, args)
        asyncio.run(warm.client_loop(0, time.monotonic() + 5))
        kat_before = run_kat(url, model)
        blocks_before = drain(url)
        rss_start = rss_pair(server.proc.pid)
        restarts_before = blocks_before.get("metrale_engine_restarts_total", 0.0)
        print(f"soak: RSS at start {rss_start}; load for {args.duration:.0f}s", flush=True)

        soak = Soak(url, model, args)
        wall = asyncio.run(soak.run(server.proc.pid))
        after = drain(url)
        kat_after = run_kat(url, model)
        rss_end = rss_pair(server.proc.pid)
        log = server.log()
    finally:
        exit_code = server.stop()
        server_log = server.log_path

    summary = soak.summary()
    total = after.get("metrale_kv_blocks_total", 0.0)
    free = after.get("metrale_kv_blocks_free", 0.0)
    cached = after.get("metrale_kv_blocks_cached", 0.0)
    leaked = int(total - free - cached)
    growth = (
        100.0 * (rss_end["total_mb"] - rss_start["total_mb"]) / rss_start["total_mb"]
        if rss_start["total_mb"]
        else None
    )
    server_growth = (
        100.0 * (rss_end["server_mb"] - rss_start["server_mb"]) / rss_start["server_mb"]
        if rss_start["server_mb"] and rss_end["server_mb"]
        else None
    )
    kat_equal = kat_before == kat_after
    by = summary["by_outcome"]
    fivexx_outside = sum(v for k, v in by.items() if k[:1] == "5") + by.get("stream_error", 0)
    verdict = {
        "no_5xx_outside_kill_window": not summary["unexpected"] and fivexx_outside == 0,
        "engine_killed_and_recovered": soak.kill_t is not None and soak.recovered_t is not None,
        "no_leaked_blocks": leaked == 0,
        "rss_growth_under_10pct": growth is not None and growth < RSS_GROWTH_LIMIT_PCT,
        "kat_equal": kat_equal,
    }
    verdict["pass"] = all(verdict.values())
    figures = {
        "wall_s": wall,
        **summary,
        "requests_per_s": summary["total_requests"] / wall if wall else None,
        "kill": {
            "at_s": args.kill_at,
            "engine_pid": soak.killed_pid,
            "recovery_s": (soak.recovered_t - soak.kill_t)
            if soak.kill_t and soak.recovered_t
            else None,
            "engine_restarts": after.get("metrale_engine_restarts_total", 0.0) - restarts_before,
        },
        "kv_blocks": {"total": total, "free": free, "cached_only": cached, "leaked": leaked},
        "rss": {
            "start": rss_start,
            "engine_before_kill_mb": soak.engine_rss_before_kill,
            "end": rss_end,
            "growth_pct": growth,
            "server_growth_pct": server_growth,
        },
        "kat": {
            "count": len(KAT),
            "equal": kat_equal,
            "diff": [
                {"index": i, "before": b, "after": a}
                for i, (b, a) in enumerate(zip(kat_before, kat_after, strict=True))
                if a != b
            ],
        },
        "server_log": {
            "error_lines": sum(
                " ERROR " in ln or ln.startswith("ERROR") for ln in log.splitlines()
            ),
            "tracebacks": log.count("Traceback (most recent call last)"),
            # The supervisor's "the engine died" line is the kill's own, expected.
            "error_samples": [ln[:300] for ln in log.splitlines() if " ERROR " in ln][:20],
            "exit_code": exit_code,
            "path": str(server_log),
        },
        "verdict": verdict,
    }
    config = {
        "duration_s": args.duration,
        "clients": args.clients,
        "kill_at_s": args.kill_at,
        "seed": args.seed,
        "mix": {
            "endpoints": ["/v1/completions", "/v1/chat/completions", "/v1/messages"],
            "disconnect_fraction": DISCONNECT_FRACTION,
            "malformed_fraction": MALFORMED_FRACTION,
            "stream_fraction": 0.5,
            "n": [1, 2, 3, 4],
            "max_tokens": [1, 4, 16, 32, 64, 128],
        },
        "model": args.model,
        "serve_args": ["--device", "cpu", "--restart-engine-on-failure", *args.serve_arg],
        "kill_grace_s": KILL_GRACE_S,
    }
    path = write_record(
        "soak",
        model_shape=Path(args.model).name,
        config=config,
        figures=figures,
        device="cpu",
        out_dir=args.out_dir,
    )
    print(json.dumps({k: figures[k] for k in ("by_outcome", "latency_s", "kv_blocks", "kat")}, indent=1))  # fmt: skip
    print(json.dumps({"rss": figures["rss"], "server_log": figures["server_log"]}, indent=1))
    print(json.dumps(verdict, indent=1))
    print(f"soak: record {path}; server log {server_log}")
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
