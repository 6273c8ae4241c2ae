"""LoRA through the HTTP API (a real `metrale serve` with its engine in a child process):
adapters from `--lora-modules` listed in `/v1/models` with `parent` the base and selected by
`model`, with the tokens the offline `LLM` gives; an adapter hot-loaded while requests stream
serves at once and disturbs none of them; an unload of an adapter in use is refused (400),
then allowed once its requests finish; error cases; the `metrale_lora_*` metrics; an adapter
loaded at run time serves the same tokens after the engine process is killed and restarted;
the runtime endpoints are off (404) without `--enable-lora-runtime-updates`."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from metrale import LLM, LoRARequest, SamplingParams
from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine
from metrale.engine.engine import Engine
from metrale.server.app import create_app
from tests.helpers.lora import ADAPTER_A, ADAPTER_B, build_adapter
from tests.server.helpers import SERVED_NAME, ServerProcess, metric, scrape, tiny_checkpoint
from tests.server.test_engine_restart import engine_pid

KEY = "lora-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [[11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48], [300, 200, 100]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def paths() -> dict[str, str]:
    base = tiny_checkpoint()
    return {
        ADAPTER_A.name: str(build_adapter(base, ADAPTER_A)),
        ADAPTER_B.name: str(build_adapter(base, ADAPTER_B)),
    }


@pytest.fixture(scope="module")
def expected(paths: dict[str, str]) -> dict[str | None, list[str]]:
    """The offline `LLM`'s greedy text of each prompt, per adapter (None: the base)."""
    llm = LLM(str(tiny_checkpoint()), device="cpu", enable_lora=True, num_kv_blocks=128)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    out: dict[str | None, list[str]] = {}
    for name in (None, ADAPTER_A.name, ADAPTER_B.name):
        lr = LoRARequest(name, 1, paths[name]) if name else None
        out[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, sp, lora_request=lr)]
    assert out[None] != out[ADAPTER_A.name] != out[ADAPTER_B.name]
    return out


@pytest.fixture(scope="module")
def server(paths: dict[str, str]) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--api-key", KEY, "--lora-modules", f"{ADAPTER_A.name}={paths[ADAPTER_A.name]}",
        "--enable-lora-runtime-updates", "--max-loras", "1", "--num-kv-blocks", "128",
        "--generation-config", "none",
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.close()


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int = MAX_TOKENS
) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "min_tokens": max_tokens}  # fmt: skip
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=60)


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        url + path, json=body, headers=AUTH if headers is None else headers, timeout=60
    )


def test_models_lists_adapters_with_parent_and_model_selects_them(
    server: ServerProcess, expected: dict[str | None, list[str]], paths: dict[str, str]
) -> None:
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [m["id"] for m in models] == [SERVED_NAME, ADAPTER_A.name]
    assert models[0]["parent"] is None
    assert models[1]["parent"] == SERVED_NAME and models[1]["root"] == paths[ADAPTER_A.name]
    card = httpx.get(server.url + f"/v1/models/{ADAPTER_A.name}", headers=AUTH, timeout=10)
    assert card.json()["parent"] == SERVED_NAME
    for model, name in ((SERVED_NAME, None), (ADAPTER_A.name, ADAPTER_A.name)):
        for prompt, text in zip(PROMPTS, expected[name], strict=True):
            reply = complete(server.url, model, prompt)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
            assert reply.json()["model"] == model
    chat = post(server.url, "/v1/chat/completions",
                {"model": ADAPTER_A.name, "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 3})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["model"] == ADAPTER_A.name, chat.text
    msg = post(server.url, "/v1/messages",
               {"model": ADAPTER_A.name, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3})  # fmt: skip
    assert msg.status_code == 200 and msg.json()["model"] == ADAPTER_A.name, msg.text
    missing = complete(server.url, "no-such-adapter", PROMPTS[0])
    assert missing.status_code == 404 and ADAPTER_A.name in missing.json()["error"]["message"]


def test_hot_load_while_traffic_runs_then_refused_unload_in_use(
    server: ServerProcess, expected: dict[str | None, list[str]], paths: dict[str, str]
) -> None:
    url = server.url
    results: list[tuple[str | None, int, str]] = []

    def traffic() -> None:
        for round_ in range(3):
            for model, name in ((SERVED_NAME, None), (ADAPTER_A.name, ADAPTER_A.name)):
                i = round_ % len(PROMPTS)
                reply = complete(url, model, PROMPTS[i])
                results.append((name, i, reply.json()["choices"][0]["text"]))

    threads = [threading.Thread(target=traffic) for _ in range(3)]
    for t in threads:
        t.start()
    loaded = post(url, "/v1/load_lora_adapter",
                  {"lora_name": ADAPTER_B.name, "lora_path": paths[ADAPTER_B.name]})  # fmt: skip
    assert loaded.status_code == 200 and "added successfully" in loaded.text, loaded.text
    poet = [complete(url, ADAPTER_B.name, p).json()["choices"][0]["text"] for p in PROMPTS]
    for t in threads:
        t.join(120)
    assert poet == expected[ADAPTER_B.name]
    assert len(results) == 18
    for name, i, text in results:
        assert text == expected[name][i]
    ids = [m["id"] for m in httpx.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"]]
    assert ids == [SERVED_NAME, ADAPTER_A.name, ADAPTER_B.name]

    # Unload while a request uses the adapter: refused; once it finished: done.
    async def unload_during_a_request() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            body = {"model": ADAPTER_B.name, "prompt": PROMPTS[1], "max_tokens": 200,
                    "min_tokens": 200, "temperature": 0, "stream": True}  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()
                async for line in lines:
                    if line.startswith("data:"):
                        break  # the request runs
                refused = await client.post(
                    "/v1/unload_lora_adapter", json={"lora_name": ADAPTER_B.name}
                )
                async for _ in lines:
                    pass
            done = await client.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER_B.name})
            return refused, done

    refused, done = asyncio.run(unload_during_a_request())
    assert refused.status_code == 400 and "in use" in refused.json()["error"]["message"]
    assert done.status_code == 200 and "removed successfully" in done.text
    gone = complete(url, ADAPTER_B.name, PROMPTS[0])
    assert gone.status_code == 404
    # The metrics show the slot pool: one slot, rotated between the adapters.
    samples = scrape(url)
    assert samples[("metrale_lora_slots", ())] == 1
    assert samples[("metrale_lora_evictions_total", ())] >= 1
    assert samples[("metrale_lora_promotions_total", ())] >= 2
    assert ("metrale_lora_requests_waiting_for_slot", ()) in samples


def test_runtime_endpoint_errors(
    server: ServerProcess, paths: dict[str, str], tmp_path: Path
) -> None:
    url = server.url
    good = {"lora_name": "x", "lora_path": paths[ADAPTER_B.name]}
    assert post(url, "/v1/load_lora_adapter", good, headers={}).status_code == 401
    missing = post(url, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)})
    assert missing.status_code == 400
    assert "adapter_config.json: missing" in missing.json()["error"]["message"]
    for name in (SERVED_NAME, ADAPTER_A.name):
        taken = post(url, "/v1/load_lora_adapter", {**good, "lora_name": name})
        assert taken.status_code == 400 and "already served" in taken.text
    assert post(url, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert post(url, "/v1/load_lora_adapter", {**good, "rank": 3}).status_code == 400
    assert post(url, "/v1/unload_lora_adapter", {"lora_name": "nope"}).status_code == 404
    # Nothing of that changed what is served.
    ids = [m["id"] for m in httpx.get(url + "/v1/models", headers=AUTH, timeout=10).json()["data"]]
    assert "x" not in ids and complete(url, ADAPTER_A.name, PROMPTS[0]).status_code == 200


def test_runtime_endpoints_are_off_without_the_flag(
    checkpoint: Path, paths: dict[str, str]
) -> None:
    config = EngineConfig(
        model=str(checkpoint), device="cpu", num_kv_blocks=64,
        lora_modules=[f"{ADAPTER_A.name}={paths[ADAPTER_A.name]}"],
    )  # fmt: skip
    handle = AsyncEngine(Engine(config))
    handle.start()
    try:
        app = create_app(handle)

        async def go() -> tuple[int, int, list[str]]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                body = {"lora_name": "b", "lora_path": paths[ADAPTER_B.name]}
                load = await c.post("/v1/load_lora_adapter", json=body)
                unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
                models = (await c.get("/v1/models")).json()["data"]
                return load.status_code, unload.status_code, [m["id"] for m in models]

        load, unload, ids = asyncio.run(go())
        assert (load, unload) == (404, 404)
        assert ids[1:] == [ADAPTER_A.name]
    finally:
        handle.shutdown()


def test_runtime_adapters_survive_an_engine_restart_under_their_ids(
    server: ServerProcess, expected: dict[str | None, list[str]], paths: dict[str, str]
) -> None:
    url = server.url
    body = {"lora_name": "poet-again", "lora_path": paths[ADAPTER_B.name]}
    assert post(url, "/v1/load_lora_adapter", body).status_code == 200
    restarts = metric(scrape(url), "metrale_engine_restarts_total")
    os.kill(engine_pid(server.proc.pid), signal.SIGKILL)
    deadline = time.monotonic() + 90
    # Wait for the restart itself (a /health probe right after the kill may still see the
    # old engine, before its death is noticed), then for the new engine.
    while metric(scrape(url), "metrale_engine_restarts_total") <= restarts:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    while httpx.get(url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.2)
    for model, name in (("poet-again", ADAPTER_B.name), (ADAPTER_A.name, ADAPTER_A.name)):
        reply = complete(url, model, PROMPTS[0])
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected[name][0]
