"""Issue 24 CI gate, KAT equality: 64 fixed requests (greedy and seeded sampling, stops,
logprobs, n > 1, prompts sharing prefixes) sent in 4 orders and concurrencies (1 in order,
4 reversed, 16 shuffled, 64 interleaved) with the prefix cache on must give byte-identical
outputs in every order (texts, tokens, finish reasons, token counts, logprobs: the JSON
answers compared as strings), and equal the known answers stored in `kat_expected.json`: a
change to numerics (or to what one request's output depends on) shows up as a diff to explain.

The engine runs with `batch_invariant=True` (`metrale.kernels.invariant`): without it, logprob
values move by ~1e-7 on the CPU with the batch a request shares and with prefix-cache hits,
while every token stays the same. Against the stored answers, logprob values are compared to
within `LOGPROB_TOL` (another CPU's vector units round differently); tokens and text exactly.

Regenerate the known answers after an intended change (and explain the diff in the commit):

    METRALE_KAT_REGEN=1 PYTHONPATH=. .venv/bin/python -m pytest -q tests/server/test_kat.py

(`cached_tokens` is left out of the comparison: it depends on what ran before, by design.)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path
from typing import Any

import httpx

from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine
from metrale.engine.engine import Engine
from metrale.server.app import create_app

EXPECTED = Path(__file__).with_name("kat_expected.json")
#: How far a logprob value may move from the stored answers (see the module docstring).
LOGPROB_TOL = 1e-4
PREFIXES = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def ",
    "# utils\n",
]
TAILS = ["", "    return", "def main():\n", "x = [1, 2, 3]\n", "for i in range(10):\n    "]


def kat_requests() -> list[dict[str, Any]]:
    """The 64 fixed requests (deterministic: built from a seeded generator)."""
    rng = random.Random(24)
    out = []
    for i in range(64):
        prompt = PREFIXES[i % 4] + TAILS[(i // 4) % 5] + f"# case {i % 7}\n"
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": rng.randint(4, 12)}
        if i % 2:
            body.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        else:
            body["temperature"] = 0
        if i % 3 == 0:
            body["stop"] = ["\n\n", ")"]
        if i % 5 == 0:
            body["logprobs"] = 2
        if i % 8 == 3:
            body["n"] = 2
        if i % 16 == 7:
            path = "/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": prompt}],
                    **{k: v for k, v in body.items() if k != "prompt" and k != "logprobs"}}  # fmt: skip
        else:
            path = "/v1/completions"
        out.append({"path": path, "body": body})
    return out


def canonical(reply: dict[str, Any]) -> str:
    """What must not depend on order: choices (text, logprobs, finish) and token counts."""
    usage = {k: reply["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return json.dumps({"choices": reply["choices"], "usage": usage}, sort_keys=True)


def same(a: Any, b: Any) -> bool:
    """Equal, except that floats (logprob values) may differ by `LOGPROB_TOL`."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= LOGPROB_TOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def run_order(app: Any, order: list[int], concurrency: int) -> dict[int, str]:
    requests = kat_requests()
    results: dict[int, str] = {}

    async def go() -> None:
        gate = asyncio.Semaphore(concurrency)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            async def one(i: int) -> None:
                async with gate:
                    r = await c.post(requests[i]["path"], json=requests[i]["body"], timeout=60)
                assert r.status_code == 200, r.text
                results[i] = canonical(r.json())

            await asyncio.gather(*(one(i) for i in order))

    asyncio.run(asyncio.wait_for(go(), 120))
    return results


def test_kat_outputs_are_identical_in_every_order(checkpoint: Path) -> None:
    config = EngineConfig(
        model=str(checkpoint), device="cpu", num_kv_blocks=256, max_num_seqs=64,
        enable_prefix_caching=True, seed=0, batch_invariant=True,
    )  # fmt: skip
    handle = AsyncEngine(Engine(config))
    handle.start()
    try:
        app = create_app(handle)
        forward = list(range(64))
        shuffled = forward[:]
        random.Random(7).shuffle(shuffled)
        interleaved = forward[::2] + forward[1::2]
        runs = {
            "sequential": run_order(app, forward, 1),
            "reversed-4": run_order(app, forward[::-1], 4),
            "shuffled-16": run_order(app, shuffled, 16),
            "interleaved-64": run_order(app, interleaved, 64),
        }
    finally:
        handle.shutdown()
    first = runs["sequential"]
    for name, results in runs.items():
        diff = [i for i in range(64) if results[i] != first[i]]  # byte for byte
        assert not diff, f"{name}: requests {diff} differ from the sequential run"
    got = {str(i): json.loads(first[i]) for i in range(64)}
    if os.environ.get("METRALE_KAT_REGEN"):
        EXPECTED.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    expected = json.loads(EXPECTED.read_text())
    diff = [i for i in got if not same(got[i], expected.get(i))]
    assert not diff, f"requests {diff} differ from kat_expected.json (regenerate: see docstring)"
