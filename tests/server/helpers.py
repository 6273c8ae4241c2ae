"""A real `metrale serve` subprocess for server tests, plus SSE and metrics readers.

Owner: tests (server). `ServerProcess` starts `python -m metrale.cli serve CKPT --port 0 ...`,
reads the bound address from the startup summary line, and waits for `/health`.

Invariants:
- The server's output goes to a temporary file (never a pipe that could fill and block it);
  `log()` returns it for assertion messages.
- `stop()` sends SIGTERM and returns the exit status; a server still running at teardown is
  killed, so no test leaves a process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.checkpoints import DENSE_VARIANTS, build

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVED_NAME = "tiny-qwen3"
_ADDRESS = re.compile(r"(http://127\.0\.0\.1:\d+)")


def tiny_checkpoint() -> Path:
    return build(next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm"))


class ServerProcess:
    def __init__(
        self, *args: str, env: dict[str, str] | None = None, checkpoint: str | None = None
    ) -> None:
        """`checkpoint`: the model directory (default: the tiny test checkpoint, served as
        `SERVED_NAME`); with one given, the served name is the server's own default."""
        name = [] if checkpoint else ["--served-model-name", SERVED_NAME]
        self.args = [
            sys.executable, "-m", "metrale.cli", "serve", checkpoint or str(tiny_checkpoint()),
            "--port", "0", "--device", "cpu", *name, *args,
        ]  # fmt: skip
        fd, name = tempfile.mkstemp(prefix="metrale-serve-", suffix=".log")
        self._log_path = Path(name)
        self._log = os.fdopen(fd, "wb")  # the server writes here for its whole life
        full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        full_env.pop("METRALE_API_KEY", None)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            self.args,
            cwd=REPO_ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.url = ""

    def log(self) -> str:
        if not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"metrale serve exited with {self.proc.returncode}:\n{self.log()}"
                )
            if not self.url:
                found = _ADDRESS.search(self.log())
                if found:
                    self.url = found.group(1)
            if self.url:
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"metrale serve did not become healthy:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.stop(timeout=15)
        self._log.close()
        self._log_path.unlink(missing_ok=True)


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str | None, str]]:
    """(event name, data) of each server-sent event in `lines`."""
    event: str | None = None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())
    if data:
        yield event, "\n".join(data)


def sse_json(lines: Iterable[str]) -> list[dict[str, Any] | str]:
    return [data if data == "[DONE]" else json.loads(data) for _, data in sse_events(lines)]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `/metrics`, keyed by (name, sorted labels); parsed by prometheus_client."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) >= {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    return error


@contextlib.contextmanager
def running_engine(checkpoint: Path, **config: Any) -> Iterator[Any]:
    """An in-process `AsyncEngine` over `checkpoint` (CPU; `config` are `EngineConfig`
    fields), started, and shut down on exit."""
    from metrale.config import EngineConfig
    from metrale.engine.async_engine import AsyncEngine
    from metrale.engine.engine import Engine

    handle = AsyncEngine(Engine(EngineConfig(model=str(checkpoint), device="cpu", **config)))
    handle.start()
    try:
        yield handle
    finally:
        handle.shutdown()


def with_sdk(app: Any, fn: Any) -> Any:
    """`await fn(client)` with the official `openai` SDK's async client talking to `app`
    in-process (over the ASGI transport of the HTTP library the SDK is built on)."""
    import asyncio

    import openai

    try:  # newer SDKs take an httpx2 client
        import httpx2 as http_lib  # type: ignore[import-not-found]
    except ImportError:
        http_lib = httpx

    async def go() -> Any:
        http = http_lib.AsyncClient(transport=http_lib.ASGITransport(app=app), base_url="http://t")
        client = openai.AsyncOpenAI(
            base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
        )
        return await fn(client)

    return asyncio.run(go())
