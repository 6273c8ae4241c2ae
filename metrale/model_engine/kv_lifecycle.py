"""`PagedKvLifecycle`: the half of `TransformerModel` that holds sequences' KV between
forwards: the prefix cache (lookup, insert, reclaim), release, block counts and swap.

Owner: model-engine. A mixin of `TransformerModel` (which sets the attributes declared below);
the forward passes live in `transformer_model.py`, speculative verify in `verify.py`.

Invariants:
- `free_sequence` drops exactly the references the sequence holds (its blocks, its prefix
  refs, its SSM slot, verify stash and unpublished decode-track snapshot, its adapter slot) and leaves it empty, so a second call releases nothing.
- `cache_sequence` never indexes a position holding `FED_TOKEN` (a fed step's unread token),
  nor past `kv_valid_tokens`.
- `lookup_prefix` runs once per sequence, before its first chunk (a replay returns the first
  answer); a partially matched last block is copied, never shared, so writes stay private.
- `blocks_needed` is `traits.blocks_needed` at this pool's block size: what a forward of that
  many rows allocates, and what the scheduler counts with.
- With KV tiers (`kv_tiers`), a block the prefix cache evicts is kept in host memory, then on
  disk, under its chain key; a lookup extends the device match with tier blocks, written into
  fresh private blocks before the prefill, and counts them as reused.
- High-speed swap (`attach_high_speed_swap`): after each forward a sequence's fully written
  blocks between its sink block and its newest `hss_window` move to `hss` (table entry
  `host_entry(id)`), and `free_sequence` returns those host ids; the scheduler counts at most
  `resident_blocks_limit()` resident blocks per sequence.
- Hybrid models with a snapshot store: lookups go through `SsmPrefixCaching._lookup_hybrid`
  (KV reused only up to a restored snapshot), `cache_sequence` publishes the sequence's decode
  track and `free_sequence` releases it if it was not published.
- A swap record holds the sequence's written KV blocks and (hybrid models) its SSM slot
  state; restoring it allocates exactly that many blocks.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from metrale.cache.block_pool import BlockPool
from metrale.cache.hss import HostKvPool, host_entry, host_id_of
from metrale.cache.kv_cache import PagedKVCache
from metrale.cache.kv_tiers import KvTiers, chain_keys
from metrale.cache.radix import RadixNode, RadixPrefixCache
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.cache.ssm_snapshots import SsmSnapshotStore
from metrale.errors import InvalidRequestError
from metrale.model_engine.ssm_verify import SsmVerifyStash
from metrale.model_engine.traits import (
    FED_TOKEN,
    PrefixReclaim,
    SequenceState,
    blocks_needed,
)

#: High-speed swap: leading blocks always kept resident (the attention sink).
HSS_SINK_BLOCKS = 1


class PagedKvLifecycle:
    """Prefix cache, release, block counts and swap over a paged KV pool (a mixin)."""

    block_pool: BlockPool
    block_size: int
    kv_cache: PagedKVCache
    ssm_pool: SsmSlotPool | None
    ssm_stash: SsmVerifyStash | None
    prefix_cache: RadixPrefixCache | None
    kv_tiers: KvTiers | None
    hss: HostKvPool | None
    hss_window: int
    snapshots: SsmSnapshotStore | None
    device: torch.device
    graph_runner: Any
    #: Lookups refused because a KV hit cannot be used on this model (hybrid SSM state).
    prefix_cache_bypasses: int
    _prefix_bypassed: bool

    if TYPE_CHECKING:  # provided through `Model` (ModelAdapters); stubs would shadow it

        def release_adapter_slot(self, slot: int) -> None: ...

        def _lookup_hybrid(self, seq: SequenceState, tokens: Sequence[int], match: Any) -> int: ...

        def _publish_track(self, seq: SequenceState, valid: int) -> None: ...

        def _release_track(self, seq: SequenceState) -> None: ...

        def snapshot_stats(self) -> dict[str, int]: ...

        def has_ssm_layers(self) -> bool: ...

    def attach_high_speed_swap(self, window: int) -> None:
        """High-speed swap: every sequence keeps its first block and its newest `window`
        blocks in the device pool; older fully written blocks move to a `HostKvPool`, which
        attention reads them from (`metrale.cache.hss`)."""
        if window < 1:
            raise InvalidRequestError(
                "high_speed_swap_blocks_per_seq must be at least 1",
                param="high_speed_swap_blocks_per_seq",
            )
        problems = [
            ("prefix caching is on", self.prefix_cache is not None),
            ("the model has recurrent layers", self.has_ssm_layers()),
            ("the CUDA graphs are on", self.graph_runner is not None),
        ]  # fmt: skip
        for why, bad in problems:
            if bad:
                raise InvalidRequestError(
                    f"high_speed_swap is refused: {why}",
                    param="high_speed_swap",
                )
        self.hss = HostKvPool(self.kv_cache)
        self.hss_window = window

    def resident_blocks_limit(self) -> int | None:
        """High-speed swap: the device blocks a sequence keeps between forwards (its sink
        block and its window); None: all of them."""
        return None if self.hss is None else HSS_SINK_BLOCKS + self.hss_window

    def _hss_offload(self, seq: SequenceState) -> None:
        """Move `seq`'s fully written blocks between its sink and its window to the host."""
        assert self.hss is not None
        table = seq.block_table
        keep_from = max(HSS_SINK_BLOCKS, len(table) - self.hss_window)
        full = seq.seq_len // self.block_size
        for i in range(HSS_SINK_BLOCKS, min(keep_from, full)):
            block = table[i]
            if block >= 0:
                table[i] = host_entry(self.hss.store(block))
                self.block_pool.decref([block])

    def attach_kv_tiers(self, tiers: KvTiers) -> None:
        """Keep what the prefix cache evicts in `tiers`, and look there on a lookup."""
        if self.prefix_cache is None or self.snapshots is not None:
            raise InvalidRequestError(
                "kv offload needs the prefix cache (enable_prefix_caching) of a model without "
                "recurrent layers (hybrid models' snapshots have no lower tier yet)",
                param="kv_offload_host_gb",
            )
        self.kv_tiers = tiers
        self.prefix_cache.on_evict = self._offload_to_tiers

    # ---------------------------------------------------------------- lifecycle

    def cache_only_blocks(self) -> int:
        return self.prefix_cache.cache_only_blocks() if self.prefix_cache is not None else 0

    def cache_sequence(self, seq: SequenceState) -> None:
        """Index the sequence's fully written blocks in the prefix cache (if there is one)."""
        if self.prefix_cache is None or not seq.block_table:
            return
        valid = min(seq.kv_valid_tokens, seq.seq_len, len(seq.tokens))
        while valid and seq.tokens[valid - 1] == FED_TOKEN:  # a fed step's unknown token
            valid -= 1
        self.prefix_cache.insert(seq.tokens[:valid], seq.block_table, seq.adapter_id)
        if self.snapshots is not None:
            self._publish_track(seq, valid)

    def prefix_match_len(self, tokens: Sequence[int], adapter_id: int) -> int:
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.match(tokens, adapter_id).reused

    def lookup_prefix(self, seq: SequenceState, tokens: Sequence[int]) -> int:
        if seq.prefix_lookup_applied:
            return seq.reused_prefix_tokens
        if seq.seq_len or seq.block_table:
            raise ValueError("the prefix lookup must run before the sequence's first chunk")
        seq.prefix_lookup_applied = True
        if self.prefix_cache is None:
            self.prefix_cache_bypasses += self._prefix_bypassed
            return 0
        match = self.prefix_cache.match(tokens, seq.adapter_id)
        if self.snapshots is not None:
            return self._lookup_hybrid(seq, tokens, match)
        blocks = [node.block for node in match.nodes]
        reused = match.reused
        if match.copy_last:
            private = self.block_pool.allocate(1)[0]
            self.kv_cache.copy_block(blocks[-1], private)
            self.block_pool.incref(blocks[:-1])
            seq.block_table = [*blocks[:-1], private]
        else:
            self.block_pool.incref(blocks)
            restored = self._restore_from_tiers(tokens, len(blocks), seq.adapter_id)
            seq.block_table = blocks = [*blocks, *restored]
            reused = len(blocks) * self.block_size
        if not blocks:
            return 0
        self.prefix_cache.touch(match.nodes)
        matched = len(blocks) * self.block_size
        seq.adopt_cached_prefix(tokens, reused, matched, len(blocks))
        return reused

    def _restore_from_tiers(self, tokens: Sequence[int], start: int, namespace: int) -> list[int]:
        """Blocks `start`, `start + 1`, ... of `tokens` brought back from the KV tiers into
        fresh private blocks (the prefix cache indexes them again when the sequence is
        cached), up to the last full block before the prompt's final token."""
        tiers = self.kv_tiers
        if tiers is None:
            return []
        bs = self.block_size
        limit = (len(tokens) - 1) // bs
        if limit <= start:
            return []
        keys = chain_keys(tokens[: limit * bs], bs, namespace)[start:]
        wanted = min(tiers.match(keys), self.block_pool.num_free)
        if wanted == 0:
            return []
        start = time.perf_counter()
        found = tiers.take_many(keys[:wanted])  # up to a damaged disk block: recomputed after
        if not found:
            return []
        restored = self.block_pool.allocate(len(found))
        self.kv_cache.write_blocks_bytes(restored, [payload for payload, _ in found])
        elapsed = time.perf_counter() - start
        for name, tier in (("host", tiers.stats.host), ("disk", tiers.stats.disk)):
            moved = sum(len(payload) for payload, where in found if where == name)
            tier.restore_bytes += moved
            # One restore spans both tiers: its time is shared by bytes.
            tier.restore_seconds += elapsed * moved / sum(len(p) for p, _ in found)
        return restored

    def _offload_to_tiers(self, node: RadixNode) -> None:
        """The prefix cache's eviction hook: keep the evicted block's KV in the tiers."""
        assert self.kv_tiers is not None and self.prefix_cache is not None
        namespace, path = self.prefix_cache.path_of(node)
        key = chain_keys(path, self.block_size, namespace)[-1]
        self.kv_tiers.put(key, self.kv_cache.block_payload(node.block))

    def reclaim_prefix_blocks(self, n: int) -> int:
        return self.prefix_cache.evict(n) if self.prefix_cache is not None else 0

    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim:
        """Evict until `blocks_needed` are free, never the prefix `prompt` will reuse.
        (`adapter_slot` is the prefix-cache namespace, i.e. the adapter id.)"""
        cache = self.prefix_cache
        short = blocks_needed - self.block_pool.num_free
        if cache is not None and short > 0:
            protected = cache.protected_blocks(prompt, adapter_slot) if prompt else set()
            cache.evict(short, protected)
        return PrefixReclaim(target=blocks_needed, free=self.block_pool.num_free)

    def prefix_cache_stats(self) -> dict[str, int]:
        stats = {"bypassed_lookups": self.prefix_cache_bypasses}
        if self.prefix_cache is not None:
            c = self.prefix_cache.stats
            stats.update(
                evicted_blocks=c.evicted_blocks,
                inserted_blocks=c.inserted_blocks,
                cached_blocks=c.cached_blocks,
            )
        if self.kv_tiers is not None:
            t = self.kv_tiers.stats
            stats.update(
                offload_host_blocks=t.host.blocks, offload_host_bytes=t.host.bytes,
                offload_host_hits=t.host.hits, offload_host_evictions=t.host.evictions,
                offload_disk_blocks=t.disk.blocks, offload_disk_bytes=t.disk.bytes,
                offload_disk_hits=t.disk.hits, offload_disk_evictions=t.disk.evictions,
                offload_corrupt=t.corrupt,
                offload_host_restore_bytes=t.host.restore_bytes,
                offload_disk_restore_bytes=t.disk.restore_bytes,
                offload_host_restore_us=int(t.host.restore_seconds * 1e6),
                offload_disk_restore_us=int(t.disk.restore_seconds * 1e6),
            )  # fmt: skip
        stats.update(self.snapshot_stats())
        return stats

    def free_sequence(self, seq: SequenceState) -> None:
        if self.ssm_stash is not None:
            self.ssm_stash.discard(seq)  # an uncommitted verify's checkpoint
        self._release_track(seq)
        if seq.block_table:
            device = [b for b in seq.block_table if b >= 0]
            if len(device) < len(seq.block_table):  # high-speed swap's host blocks
                assert self.hss is not None
                self.hss.free([host_id_of(b) for b in seq.block_table if b < 0])
            self.block_pool.decref(device)
        seq.block_table = []
        seq.seq_len = 0
        seq.tokens = []
        seq.kv_valid_tokens = 0
        seq.proposer_state = None
        if seq.ssm_slot is not None:
            seq.ssm_slot.release()
            seq.ssm_slot = None
        if seq.acquired_adapter_slot >= 0:
            self.release_adapter_slot(seq.acquired_adapter_slot)
            seq.acquired_adapter_slot = -1

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def blocks_needed(self, seq: SequenceState, new_tokens: int) -> int:
        return blocks_needed(seq, new_tokens, self.block_size)

    def num_total_blocks(self) -> int:
        return self.block_pool.num_usable

    def kv_block_size(self) -> int:
        return self.block_size

    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None:
        """Serialise the sequence's written KV blocks and its SSM slot state (host copies)
        for swap-out (an uncommitted verify's checkpoint is discarded, not carried)."""
        if self.ssm_stash is not None:
            self.ssm_stash.discard(seq)
        data = self.kv_cache.read_blocks(seq.block_table) if seq.block_table else []
        payload: dict[str, Any] = {"num_blocks": len(seq.block_table), "kv": data}
        slot = seq.ssm_slot_idx()
        if self.ssm_pool is not None and slot is not None:
            payload["ssm"] = self.ssm_pool.read_slot(slot)
        pickle.dump(payload, writer)

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        """Allocate `num_blocks` blocks and fill them from `save_sequence_state` output."""
        payload: dict[str, Any] = pickle.load(reader)
        if payload["num_blocks"] != num_blocks:
            raise ValueError(
                f"swap record holds {payload['num_blocks']} blocks, expected {num_blocks}"
            )
        slot = seq.ssm_slot_idx()
        if self.ssm_pool is not None and (slot is None or "ssm" not in payload):
            raise ValueError("swap-in of a hybrid sequence needs its SSM state and a slot")
        blocks = self.block_pool.allocate(num_blocks)
        if num_blocks:
            self.kv_cache.write_blocks(blocks, payload["kv"])
        seq.block_table = blocks
        if self.ssm_pool is not None and slot is not None:
            self.ssm_pool.write_slot(slot, payload["ssm"])
