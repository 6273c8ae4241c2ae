"""Issue 19: the prefix cache's host and disk tiers through the engine. A long prompt whose
blocks a tiny device pool evicted is answered with `cached_tokens > 0` from the host tier,
then from the disk tier, and after a restart from the disk tier, with tokens identical to a
cold run; a damaged disk block is recomputed; random traffic keeps every block accounted for."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from metrale import LLM, SamplingParams
from tests.server.helpers import tiny_checkpoint

LONG = "def fibonacci(n):\n" + "    # compute the n-th number of the sequence\n" * 4
OTHERS = [f"class Thing{i}:\n" + f"    value = {i}\n" * 12 for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def payload_bytes(llm: LLM) -> int:
    return len(llm.engine.model.kv_cache.block_bytes(1))


def make(tmp: Path | None, host_blocks: int, disk_blocks: int = 0, probe: LLM | None = None) -> LLM:
    size = payload_bytes(probe) if probe is not None else 0
    extra: dict[str, Any] = {}
    if size:
        extra["kv_offload_host_gb"] = host_blocks * size / 2**30
        if tmp is not None:
            extra.update(kv_offload_disk=str(tmp), kv_offload_disk_gb=disk_blocks * size / 2**30)
    return LLM(str(tiny_checkpoint()), device="cpu", num_kv_blocks=32, block_size=8, **extra)


def evict_then_ask(llm: LLM) -> Any:
    llm.generate([LONG], PARAMS)
    llm.generate(OTHERS, PARAMS)  # pushes LONG's blocks out of the 31-block device pool
    return llm.generate([LONG], PARAMS)[0]


def test_host_then_disk_then_restart(tmp_path: Path) -> None:
    cold_llm = make(None, 0)
    cold = cold_llm.generate([LONG], PARAMS)[0]
    # The same prefix from the device cache: the tiers must give exactly its result (a cold
    # run's prefill takes the whole prompt at once, whose float32 sums may round otherwise).
    device_hit = cold_llm.generate([LONG], PARAMS)[0]
    assert evict_then_ask(cold_llm).num_cached_tokens == 0  # without tiers: gone

    host = make(None, 64, probe=cold_llm)
    warm = evict_then_ask(host)
    stats = host.engine.model.prefix_cache_stats()
    assert warm.num_cached_tokens > 0 and stats["offload_host_hits"] > 0
    restored = stats["offload_host_hits"] * payload_bytes(host)  # the restore bandwidth's parts
    assert stats["offload_host_restore_bytes"] == restored and stats["offload_host_restore_us"] > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.num_cached_tokens == device_hit.num_cached_tokens
    assert warm.outputs[0].logprobs == device_hit.outputs[0].logprobs

    disk = make(tmp_path, 2, 64, probe=cold_llm)  # a 2-block host tier spills to disk
    warm = evict_then_ask(disk)
    stats = disk.engine.model.prefix_cache_stats()
    assert warm.num_cached_tokens > 0 and stats["offload_disk_hits"] > 0
    assert stats["offload_disk_restore_bytes"] == stats["offload_disk_hits"] * payload_bytes(disk)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    disk.generate(OTHERS, PARAMS)  # LONG's blocks leave the device again
    model = disk.engine.model
    model.kv_tiers.flush()
    assert model.kv_tiers.stats.disk.blocks > 0

    restarted = make(tmp_path, 2, 64, probe=cold_llm)  # a new engine over the same directory
    out = restarted.generate([LONG], PARAMS)[0]
    assert out.num_cached_tokens > 0
    assert restarted.engine.model.prefix_cache_stats()["offload_disk_hits"] > 0
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids

    # Damage every block file: detected, recomputed, same tokens.
    restarted.generate(OTHERS, PARAMS)
    restarted.engine.model.kv_tiers.flush()
    for f in tmp_path.glob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x55
        f.write_bytes(bytes(data))
    again = make(tmp_path, 0, 64, probe=cold_llm)
    out = again.generate([LONG], PARAMS)[0]
    assert again.engine.model.prefix_cache_stats()["offload_corrupt"] > 0
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000))
@example(seed=450)  # a block evicted again while its older copy was on disk
def test_random_traffic_accounts_for_every_block(tmp_path_factory: Any, seed: int) -> None:
    rng = random.Random(seed)
    probe = make(None, 0)
    llm = make(tmp_path_factory.mktemp("tiers"), 3, 6, probe=probe)
    prompts = [LONG, *OTHERS]
    for _ in range(4):
        batch = [rng.choice(prompts)[: rng.randint(20, 400)] for _ in range(rng.randint(1, 4))]
        outs = llm.generate(batch, PARAMS)
        for prompt, out in zip(batch, outs):
            assert (
                out.outputs[0].token_ids == probe.generate([prompt], PARAMS)[0].outputs[0].token_ids
            )
    model = llm.engine.model
    model.kv_tiers.flush()
    assert model.num_free_blocks() + model.cache_only_blocks() == model.num_total_blocks()
    tiers = model.kv_tiers
    assert tiers.stats.host.bytes == sum(map(len, tiers.host.items.values()))
    assert tiers.disk is not None
    assert tiers.stats.disk.bytes == sum(tiers.disk.index.values())
    assert not set(tiers.host.items) & set(tiers.disk.index)
