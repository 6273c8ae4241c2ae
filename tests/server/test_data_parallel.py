"""Data-parallel replicas (`--data-parallel-size 2`): two `EngineProcess` replicas behind one
`ReplicatedEngine` and one HTTP app serve concurrent requests on both replicas with the tokens
of one engine (DP=1); a repeated long prefix goes to the replica that cached it (its own prefix
cache hits); a replica that dies fails its in-flight request with a clear error while the server
keeps serving on the other; `metrale serve --data-parallel-size 2` starts and reports both."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from metrale import LLM, SamplingParams
from metrale.config import EngineConfig
from metrale.engine.engine_process import EngineProcess
from metrale.engine.replicas import ReplicatedEngine, build_replicas, replica_envs
from metrale.engine.router import block_hashes
from metrale.engine.supervisor import SupervisedEngine
from metrale.errors import EngineDeadError
from metrale.server.app import create_app
from tests.helpers.lora import ADAPTER_B, build_adapter
from tests.server.helpers import SERVED_NAME, ServerProcess, metric, scrape, tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _replicated(checkpoint: Path, *, restart: bool) -> ReplicatedEngine:
    config = EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=96)
    envs = replica_envs("cpu", 2)

    def factory(env: dict[str, str]):  # type: ignore[no-untyped-def]
        return lambda: SupervisedEngine(
            lambda: EngineProcess(config, child_env=env), restart=restart
        )

    engine = ReplicatedEngine(build_replicas([factory(env) for env in envs]))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def dp(checkpoint: Path) -> Iterator[ReplicatedEngine]:
    engine = _replicated(checkpoint, restart=False)
    try:
        yield engine
    finally:
        engine.shutdown()


async def _tokens(engine: ReplicatedEngine, rid: str, ids: list[int]) -> list[int]:
    stream = await engine.add_request(rid, None, GREEDY, prompt_token_ids=ids)
    last = None
    async for out in stream:
        last = out
    assert last is not None and last.finished
    return list(last.outputs[0].token_ids)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    return [[(seed * 131 + i * 17 + j * 7) % 400 + 5 for j in range(length)] for i in range(n)]


def test_concurrent_requests_use_both_replicas_with_dp1_tokens(
    dp: ReplicatedEngine, reference: LLM
) -> None:
    prompts = _prompts(8, 24, seed=1)
    before = [s.routed_prefix + s.routed_load for s in dp.replica_stats()]

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(_tokens(dp, f"c{i}", p) for i, p in enumerate(prompts)))

    got = asyncio.run(run())
    want = [list(o.outputs[0].token_ids) for o in reference.generate(prompts, GREEDY)]
    assert got == want
    used = [s.routed_prefix + s.routed_load - b for s, b in zip(dp.replica_stats(), before)]
    assert sum(used) == 8 and min(used) >= 2, used  # a burst spreads over both replicas


def test_a_repeated_long_prefix_goes_to_the_replica_that_cached_it(dp: ReplicatedEngine) -> None:
    prefix = _prompts(1, 80, seed=2)[0]  # 5 blocks of 16
    others = _prompts(6, 40, seed=3)

    async def run() -> None:
        await _tokens(dp, "p0", [*prefix, 1])
        home = _home_of(dp, [*prefix, 1])
        hits = dp.replica_stats()[home].snapshot.stats.prefix_hit_tokens
        routed = dp.replica_stats()[home].routed_prefix
        # The same prefix again, concurrently with unrelated prompts that spread by load.
        jobs = [_tokens(dp, f"p{k}", [*prefix, 2 + k, 9]) for k in range(1, 4)]
        jobs += [_tokens(dp, f"o{k}", p) for k, p in enumerate(others)]
        await asyncio.gather(*jobs)
        stats = dp.replica_stats()
        assert stats[home].routed_prefix - routed == 3
        await asyncio.sleep(0.3)  # the idle snapshot carries the last counters
        stats = dp.replica_stats()
        assert stats[home].snapshot.stats.prefix_hit_tokens - hits >= 3 * 80

    asyncio.run(run())


def _home_of(engine: ReplicatedEngine, ids: list[int]) -> int:
    """The one replica the router records as holding all of `ids`' full blocks."""
    hashes = block_hashes(ids, engine.block_size)
    matches = [engine.router.matched_blocks(i, hashes) for i in range(engine.num_replicas)]
    assert sorted(matches) == [0, len(hashes)], matches
    return matches.index(len(hashes))


def test_a_dead_replica_fails_its_requests_and_the_other_keeps_serving(
    dp: ReplicatedEngine, reference: LLM
) -> None:
    """Kills both replicas of the module's engine (restarts off): keep it the module's last
    in-process test."""
    engine = dp
    app = create_app(engine, served_model_name=SERVED_NAME)
    prompt = _prompts(1, 20, seed=4)[0]
    room = engine.info.max_model_len - len(prompt)
    long = SamplingParams(temperature=0, max_tokens=room, ignore_eos=True)

    async def run() -> None:
        stream = await engine.add_request("victim", None, long, prompt_token_ids=prompt)
        victim = next(i for i, r in enumerate(engine.replicas) if r.num_open_requests())
        os.kill(engine.replicas[victim].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            async for _ in stream:
                pass
        # The same prompt now goes to the survivor, with the tokens of one engine.
        got = await _tokens(engine, "after", prompt)
        want = reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
        assert got == list(want)
        assert engine.replica_stats()[1 - victim].open_requests == 0
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            body = (await client.get("/metrics")).text
            assert f'metrale_dp_replica_alive{{replica="{victim}"}} 0.0' in body
            assert f'metrale_dp_replica_alive{{replica="{1 - victim}"}} 1.0' in body
            answer = await client.post(
                "/v1/completions",
                json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0},
            )
            assert answer.status_code == 200, answer.text
        # The survivor dies too: now the server says so (503) instead of hanging.
        survivor = engine.replicas[1 - victim]
        os.kill(survivor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while survivor.dead_error is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with pytest.raises(EngineDeadError, match="all 2 data-parallel replicas are down"):
            await engine.add_request("none", None, GREEDY, prompt_token_ids=prompt)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 503

    asyncio.run(run())


def test_serve_data_parallel_size_2_end_to_end() -> None:
    """The command: flags, summary, routed counters, the card; a LoRA adapter loaded at run
    time reaches both replicas (a replica without it would refuse the request)."""
    adapter = str(build_adapter(tiny_checkpoint(), ADAPTER_B))
    server = ServerProcess(
        "--data-parallel-size", "2", "--num-kv-blocks", "64", "--enable-lora-runtime-updates",
        "--generation-config", "none",
    )  # fmt: skip
    try:
        server.wait_ready(timeout=120)
        prompt = "def fibonacci(n):"
        for _ in range(3):
            answer = httpx.post(
                server.url + "/v1/completions",
                json={"model": SERVED_NAME, "prompt": prompt * 8, "max_tokens": 4},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
        samples = scrape(server.url)
        routed = [
            metric(samples, "metrale_dp_requests_routed_total", replica=str(i), reason=reason)
            for i in range(2)
            for reason in ("prefix", "load")
        ]
        assert sum(routed) == 3 and sorted(routed)[-1] == 2  # the repeat went to its replica
        assert metric(samples, "metrale_kv_blocks_total") == 2 * 63
        assert "data-parallel replica 1" in server.log()
        (card,) = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert card["data_parallel_size"] == 2

        load = {"lora_name": ADAPTER_B.name, "lora_path": adapter}
        answer = httpx.post(server.url + "/v1/load_lora_adapter", json=load, timeout=60)
        assert answer.status_code == 200, answer.text
        texts: dict[str, list[str]] = {}
        # Under one block: routed by load (equal loads: to the replica sent fewer requests so
        # far: 3 went to one replica above, so 5 reach both).
        short = [11, 12, 13, 14, 15]
        for model in [ADAPTER_B.name] * 5 + [SERVED_NAME]:
            body = {"model": model, "prompt": short, "max_tokens": 8, "min_tokens": 8,
                    "temperature": 0}  # fmt: skip
            answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200, answer.text
            texts.setdefault(model, []).append(answer.json()["choices"][0]["text"])
        adapted = texts[ADAPTER_B.name]
        assert adapted == [adapted[0]] * 5 and adapted[0] != texts[SERVED_NAME][0]
        after = scrape(server.url)
        for i in range(2):  # each replica served some of the adapter requests
            grew = sum(
                metric(after, "metrale_dp_requests_routed_total", replica=str(i), reason=r)
                - metric(samples, "metrale_dp_requests_routed_total", replica=str(i), reason=r)
                for r in ("prefix", "load")
            )
            assert grew >= 1, (i, grew)
    finally:
        server.close()
