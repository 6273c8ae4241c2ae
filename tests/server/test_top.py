"""`metrale top` against a real server: the bundled model served with MTP speculation and an
API key, some requests run first; `--once` prints every field with its live value. A server
that cannot be reached, or refuses the key, gets one line and exit 1 / 2, no traceback. The
frame arithmetic (rates, histogram quantiles over the window) is checked on synthetic scrapes.

Owner: tests (server).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from metrale.engine.intake import BUNDLED_MODEL_DIR
from metrale.top.frame import Window, build_frame, quantile
from metrale.top.scrape import Scrape, TopError, normalize_url
from metrale.top.view import render_text, sections
from tests.server.helpers import REPO_ROOT, ServerProcess

KEY = "top-secret"
SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--num-kv-blocks", "256", "--api-key", KEY, "--speculative-config", SPEC,
        checkpoint=str(BUNDLED_MODEL_DIR),
    ).wait_ready()  # fmt: skip
    try:
        yield proc
    finally:
        proc.close()


def _top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "metrale.cli", "top", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _field(text: str, label: str) -> str:
    found = re.search(rf"^  {re.escape(label)} +(.+)$", text, re.MULTILINE)
    assert found, f"no {label!r} in:\n{text}"
    return found.group(1).strip()


def _number(text: str, label: str) -> float:
    return float(_field(text, label).split()[0].replace(",", "").rstrip("%"))


def test_once_shows_the_live_values(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "def fibonacci(n):\n", "max_tokens": 24, "temperature": 0}

    def complete(_: int) -> int:
        return httpx.post(
            server.url + "/v1/completions", json=body, headers=headers, timeout=60
        ).status_code

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(complete, range(4))) == [200] * 4
    bad = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": -1},
                     headers=headers, timeout=30)  # fmt: skip
    assert bad.status_code == 400

    done = _top("--url", server.url, "--api-key", KEY, "--once", "--interval", "0.3")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for title in ("server", "requests", "throughput", "latency", "KV cache", "trouble",
                  "speculation"):  # fmt: skip
        assert f"[{title}" in out, out
    assert "[LoRA]" not in out  # no such metrics: no panel
    assert _field(out, "model") == BUNDLED_MODEL_DIR.name  # served under its directory name
    assert _field(out, "dtype") == "float32"
    assert _field(out, "engine alive") == "yes"
    assert _number(out, "running") == 0 and _number(out, "waiting") == 0
    assert _number(out, "swapped") == 0
    assert _number(out, "generation tokens") >= 4 * 24 - 4  # every stream's tokens
    assert _number(out, "prompt tokens") > 0
    assert _field(out, "generation tok/s") != "-" and _field(out, "prompt tok/s") != "-"
    # The requests ended before the two scrapes: the percentiles cover the server's life.
    assert "[latency (since start)]" in out
    assert _field(out, "TTFT p50").endswith(" ms") and _number(out, "TTFT p99") > 0
    assert _number(out, "ITL p50") > 0
    assert _number(out, "blocks total") == 255
    assert _number(out, "blocks used") == 0  # nothing running
    assert _number(out, "blocks cached") > 0  # the prompts' blocks stay in the prefix cache
    assert "%" in _field(out, "prefix hit rate")
    assert _number(out, "preemptions") == 0 and _number(out, "aborts") == 0
    assert "400: 1" in _field(out, "errors")
    assert _number(out, "drafts") > 0 and _number(out, "draft tokens") > 0
    assert len(_field(out, "per position").split()) == 3


def test_bad_key_and_unreachable_are_one_line(server: ServerProcess) -> None:
    done = _top("--url", server.url, "--api-key", "wrong", "--once", "--interval", "0.1")
    assert done.returncode == 2, done
    assert done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.startswith("metrale top: ") and done.stderr.count("\n") == 1
    assert "refused the API key (401)" in done.stderr

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = _top("--url", f"127.0.0.1:{port}", "--once")
    assert done.returncode == 1, done
    assert done.stderr.startswith(f"metrale top: cannot reach http://127.0.0.1:{port}/metrics")
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    with pytest.raises(TopError) as err:
        normalize_url("ftp://x")
    assert err.value.exit_code == 2


def _scrape(t: float, tokens: float, buckets: dict[str, float], **extra: float) -> Scrape:
    name = "metrale_inter_token_latency_seconds"
    samples = {(f"{name}_bucket", (("le", le),)): v for le, v in buckets.items()}
    samples[(f"{name}_count", ())] = tokens
    samples[("metrale_engine_alive", ())] = 1.0
    for key, value in extra.items():
        samples[(key, ())] = value
    return Scrape(t, samples)


def test_rates_and_percentiles_come_from_deltas() -> None:
    # 100 observations before the window, then 10 more: 8 under 10 ms, 2 in (10, 50] ms.
    old = _scrape(0.0, 100, {"0.01": 100, "0.05": 100, "+Inf": 100})
    mid = _scrape(30.0, 104, {"0.01": 104, "0.05": 104, "+Inf": 104})
    new = _scrape(31.0, 110, {"0.01": 108, "0.05": 110, "+Inf": 110})
    frame = build_frame("u", [old, mid, new])
    assert frame.generation_tok_s == pytest.approx(6.0)  # (110 - 104) / 1 s
    assert frame.itl_p50 == pytest.approx(0.01 * 5 / 8)
    assert frame.itl_p99 == pytest.approx(0.01 + 0.04 * (9.9 - 8) / 2)
    assert frame.ttft_p50 is None  # no TTFT observations: no data, not 0
    assert frame.latency_scope == "last 31s"
    assert frame.spec is None and frame.lora is None
    assert quantile(0.5, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.99, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0  # +Inf: last bound
    one = build_frame("u", [new])
    assert one.generation_tok_s is None and "- (2 scrapes)" in render_text(one)
    assert one.latency_scope == "since start" and one.itl_p50 is not None
    # The window keeps the newest scrape at least a minute old as its baseline.
    window = Window(60.0)
    for t in (0.0, 30.0, 61.0, 62.0, 125.0):
        window.add(_scrape(t, 0, {"+Inf": 0}))
    assert [s.time for s in window.scrapes] == [62.0, 125.0]
    lora = _scrape(1.0, 0, {}, metrale_lora_requests_total=3)
    assert [t for t, _ in sections(build_frame("u", [lora]))][-1] == "LoRA"
