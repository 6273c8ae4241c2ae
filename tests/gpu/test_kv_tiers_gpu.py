"""Issue 19 on CUDA: a batched restore (pinned host buffer, asynchronous copies, one scatter
per layer tensor) writes the device blocks bit for bit, across staging chunks; and a prompt
whose blocks the device pool evicted comes back from the host tier with the cold run's tokens.
Marked `gpu`; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.cache import kv_cache
from tests.helpers.checkpoints import DENSE_VARIANTS, build

pytestmark = pytest.mark.gpu


def _random_pool():  # type: ignore[no-untyped-def]
    """A bf16 CUDA KV pool (4 layers, 64 blocks of 16, 2 heads of 64) filled with normal
    values, and the constructor of empty ones of the same shape."""

    def pool() -> kv_cache.PagedKVCache:
        return kv_cache.PagedKVCache(4, 64, 16, 2, 64, torch.bfloat16, torch.device("cuda"))

    src = pool()
    for k, v in src.layers:
        k.normal_()
        v.normal_()
    return src, pool


def test_batched_restore_on_cuda_is_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    src, pool = _random_pool()
    ids = list(range(1, 40))
    payloads = [src.block_bytes(b) for b in ids]
    monkeypatch.setattr(kv_cache, "_STAGING_BYTES", 5 * len(payloads[0]))  # 8 chunks
    dst = pool()
    targets = [63 - b for b in ids]
    dst.write_blocks_bytes(targets, payloads)
    torch.cuda.synchronize()
    for (k1, v1), (k2, v2) in zip(src.layers, dst.layers, strict=True):
        assert torch.equal(k1[ids], k2[targets]) and torch.equal(v1[ids], v2[targets])


def test_pinned_host_blocks_restore_bit_exact_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload path's payloads: pinned host tensors filled by an asynchronous copy, then
    restored by a DMA each; mixed with bytes payloads (the disk tier's), across chunks."""
    from metrale.cache.kv_tiers import payload_bytes

    src, pool = _random_pool()
    ids = list(range(1, 40))
    payloads = [src.block_payload(b) if b % 3 else src.block_bytes(b) for b in ids]
    assert all(p.data.is_pinned() for p in payloads if not isinstance(p, bytes))
    for k, v in src.layers:  # overwrites after the copies were issued must not reach them
        k[1:40].zero_()
        v[1:40].zero_()
    monkeypatch.setattr(kv_cache, "_STAGING_BYTES", 5 * len(payloads[0]))  # 8 chunks
    dst = pool()
    targets = [63 - b for b in ids]
    dst.write_blocks_bytes(targets, payloads)
    torch.cuda.synchronize()
    assert [dst.block_bytes(t) for t in targets] == [payload_bytes(p) for p in payloads]
    assert all(any(x != 0 for x in payload_bytes(p)[:64]) for p in payloads)
    rows = src._pinned
    assert rows is not None and len(rows.slabs) == 1  # 26 host blocks in one slab
    assert len(rows.free) == rows.rows_per_slab - 26
    del payloads
    assert len(rows.free) == rows.rows_per_slab  # collected payloads give their rows back


def test_host_tier_on_cuda_gives_the_cold_tokens() -> None:
    variant = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
    path = str(build(variant))
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    long = list(range(6, 6 + 100))
    others = [list(range(200 + 50 * i, 250 + 50 * i)) for i in range(6)]
    cold = LLM(path, device="cuda", dtype="float32", num_kv_blocks=32, block_size=8)
    want = cold.generate([long], params)[0].outputs[0].token_ids
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=32, block_size=8,
              kv_offload_host_gb=0.05)  # fmt: skip
    llm.generate([long], params)
    llm.generate(others, params)  # pushes the long prompt's blocks out of the device pool
    again = llm.generate([long], params)[0]
    stats = llm.engine.model.prefix_cache_stats()
    assert again.num_cached_tokens > 0 and stats["offload_host_hits"] > 0
    assert stats["offload_host_restore_bytes"] > 0
    assert again.outputs[0].token_ids == want


def test_high_speed_swap_on_cuda_matches_the_resident_run() -> None:
    """A sequence 8x longer than its device window, its older blocks in pinned host memory
    and gathered per layer for the Triton kernels, gives the resident run's tokens."""
    variant = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
    path = str(build(variant))
    prompts = [list(range(6, 6 + 120)), list(range(300, 300 + 90))]
    params = SamplingParams(temperature=0, max_tokens=80, min_tokens=80, logprobs=2)
    resident = LLM(path, device="cuda", dtype="float32", num_kv_blocks=128, block_size=8,
                   enable_prefix_caching=False).generate(prompts, params)  # fmt: skip
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=24, block_size=8,
              enable_prefix_caching=False, high_speed_swap=True,
              high_speed_swap_blocks_per_seq=2, max_prefill_chunk=16)  # fmt: skip
    swapped = llm.generate(prompts, params)
    for a, b in zip(swapped, resident, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        pairs = zip(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].logprobs)
        for tok, x, y in pairs:
            assert abs(x[tok].logprob - y[tok].logprob) < 1e-3
    model = llm.engine.model
    assert model.hss is not None and model.hss.cuda and model.hss.stored_blocks > 40
    assert model.hss.host_block_reads > 0 and model.hss.held == 0
    assert all(k.is_pinned() for k, _ in model.hss.layers)
