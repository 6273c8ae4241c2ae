"""Checks shared by engine tests.

Owner: tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metrale import Engine, SamplingParams
from metrale.engine.request import RequestOutput


def assert_no_leaks(engine: Engine) -> None:
    """Nothing is held by a sequence: every usable block is free or held only by the prefix
    cache, and once the cache is emptied every block is free (all but the null block); on
    hybrid models every SSM slot is free, no verify checkpoint is stashed, the snapshot store's
    accounting holds and no snapshot outlives the cache's KV; with LoRA no slot ref is held."""
    model = engine.model
    assert not engine.has_unfinished()
    pool = model.block_pool
    pool.check()
    snapshots = getattr(model, "snapshots", None)
    if snapshots is not None:  # hybrid prefix caching: no sequence keeps a decode track
        snapshots.check()
        assert snapshots.num_private() == 0, "a decode-track snapshot outlived its sequence"
    cache = model.prefix_cache
    cache_only = cache.cache_only_blocks() if cache is not None else 0
    cached = len(cache.cached_block_ids()) if cache is not None else 0
    assert cache_only == cached, "a finished sequence still references a cached block"
    assert model.num_free_blocks() + cache_only == model.num_total_blocks()
    model.reclaim_prefix_blocks(model.num_total_blocks())
    assert model.num_free_blocks() == model.num_total_blocks()
    pool.check()
    lora = getattr(model, "lora", None)
    if lora is not None:  # every LoRA slot ref comes back
        held = [lora.refs(i) for i in range(lora.slots.num_slots)]
        assert held == [0] * len(held), f"LoRA slot refs still held: {held}"
    if snapshots is not None:  # every snapshot went with its node's KV
        snapshots.check()
        assert snapshots.num_used() == 0 and snapshots.pool.num_free() == snapshots.num_slots
    ssm_pool = getattr(model, "ssm_pool", None)
    if ssm_pool is not None:  # hybrid models: every SSM slot and verify stash comes back
        assert ssm_pool.num_free() == ssm_pool.num_slots and ssm_pool.num_allocated() == 0
        assert len(model.ssm_stash) == 0, "a verify checkpoint outlived its sequence"


def run_aborting(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    abort_at_step: int,
    aborted: Sequence[int] = (2, 4),
) -> dict[str, RequestOutput]:
    """Add `prompts` as requests `r0, r1, ...`, step the engine to the end and abort the
    requests numbered `aborted` after step `abort_at_step`; the final output of each request
    that finished, by request id."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=list(p))
    finals: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps == abort_at_step:
            for i in aborted:
                engine.abort_request(f"r{i}")
    return finals


def assert_snapshots_match_cold(model: Any, reference: Any) -> None:
    """Every SSM snapshot `model`'s prefix cache holds equals, to 1e-4 of the state's scale
    (the SSM states of the tiny checkpoints are small), the recurrent state `reference` (a
    model with the same weights) leaves after one cold prefill of the snapshot node's path."""
    cache, store = model.prefix_cache, model.snapshots
    nodes = [c for root in cache.roots.values() for c in root.children.values()]
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children.values())
        if node.snapshot is None:
            continue
        path: list[int] = []
        up = node
        while up.parent is not None:
            path[:0] = up.chunk
            up = up.parent
        seq = reference.alloc_sequence()
        try:
            reference.prefill_chunk(path, seq, 0, len(path), False)
            slot, snap = seq.ssm_slot_idx(), node.snapshot.slot
            cold = reference.ssm_pool.layers
            for (conv, ssm), (cconv, cssm) in zip(store.pool.layers, cold, strict=True):
                for got, want in ((conv[snap], cconv[slot]), (ssm[snap], cssm[slot])):
                    scale = want.abs().max().item()
                    assert (got - want).abs().max().item() <= 1e-4 * scale, node.snapshot
        finally:
            reference.free_sequence(seq)
