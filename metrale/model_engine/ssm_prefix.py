"""`SsmPrefixCaching`: prefix caching on hybrid (recurrent + attention) models, the model-engine
half: where snapshots of the recurrent state are taken, how a lookup restores one, and how a
sequence's snapshots are published or released when it ends.

Owner: model-engine. A mixin of `TransformerModel` (which sets `snapshots`, the
`SsmSnapshotStore`, when the model is hybrid and prefix caching is on). The store and its
eviction rule live in `metrale/cache/ssm_snapshots.py`, the index in `metrale/cache/radix.py`.

Where snapshots come from:
- Two-phase prefill: the prompt's tail split (`prefill_tail_split`: the last block boundary
  strictly below its end) and, when the lookup matched KV past its deepest snapshot, that
  branch point. The scheduler ends a prefill chunk at each (`prefill_capture_point`); right
  after the forward that reaches one, the sequence's blocks up to it are indexed in the radix
  tree and the live state is copied onto that node (published at once, so concurrent
  siblings hit it too). A point within `snapshot_min_gap_tokens` (default `NEAR_BLOCKS`
  blocks; 512 tokens on CUDA) of the restored snapshot, or a branch point that close to the
  tail, is skipped (each split costs a forward).
- Decode: each time a plain decode step (or a committed verify) leaves the sequence on a block
  boundary, its live state is copied into the sequence's private decode track
  (`decode_marconi_checkpoint`), refreshed in place; when the sequence is cached (finish,
  recompute preemption) the track is published at its position, so the next turn of the
  conversation (this turn's prompt and answer plus a new message) hits there.

Invariants:
- A hit restores a snapshot at a block-aligned position `p < len(prompt)` into the sequence's
  live slot and shares exactly the KV blocks before `p`; `reused_prefix_tokens` (reported as
  `cached_tokens`) is `p`, tokens whose KV and state were both reused. Nothing is shared across
  prefix namespaces (adapter ids, tenants): the radix roots keep them apart.
- A snapshot is only taken right after a forward that left the sequence's state covering
  exactly `seq_len` tokens, all committed (verify rows snapshot only after their commit).
- `free_sequence` releases a decode track that was not published (abort, swap-out, error), so
  every exit path returns the sequence's snapshot slots exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from metrale.cache.radix import PrefixMatch, RadixPrefixCache
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.cache.ssm_snapshots import Snapshot, SsmSnapshotStore
from metrale.model_engine.batch import ForwardRow
from metrale.model_engine.traits import SequenceState

#: Blocks within which a capture point is skipped when another snapshot of the same prompt
#: (restored or planned) lies (A.6: "skip a capture if another snapshot of the same request
#: lies within 2 granules").
NEAR_BLOCKS = 2


class SsmPrefixCaching:
    """Recurrent-state snapshots for the prefix cache (a mixin of `TransformerModel`)."""

    snapshots: SsmSnapshotStore | None
    #: Captures closer than this to another snapshot of the prompt are skipped (the factory
    #: sets it from `EngineConfig.ssm_snapshot_min_gap_tokens`); None: `NEAR_BLOCKS` blocks.
    snapshot_min_gap_tokens: int | None = None
    ssm_pool: SsmSlotPool | None
    prefix_cache: RadixPrefixCache | None
    block_size: int

    if TYPE_CHECKING:  # provided by `PagedKvLifecycle` / `TransformerModel`
        from metrale.cache.block_pool import BlockPool

        block_pool: BlockPool

    # ------------------------------------------------------------------ planning

    def prefill_tail_split(self, tokens: Sequence[int]) -> int | None:
        """Where two-phase prefill snapshots a prompt: the last block boundary strictly below
        its end (a repeat or the next turn matches at most up to there), None when none."""
        if self.snapshots is None:
            return None
        split = (len(tokens) - 1) // self.block_size * self.block_size
        return split or None

    def prefill_capture_point(self, seq: SequenceState) -> int | None:
        """The next position past `seq_len` where a prefill chunk must end so the recurrent
        state there can be snapshotted; None when there is none."""
        points = [p for p in (seq.ssm_branch_tokens, seq.tail_checkpoint_tokens) if p]
        ahead = [p for p in points if p > seq.seq_len]
        return min(ahead) if ahead else None

    # ------------------------------------------------------------------ lookup

    def _lookup_hybrid(self, seq: SequenceState, tokens: Sequence[int], match: PrefixMatch) -> int:
        """`lookup_prefix` on a hybrid model: restore the match's snapshot (if any), share the
        KV before it and plan this prompt's capture points."""
        store, cache, pool = self.snapshots, self.prefix_cache, self.ssm_pool
        assert store is not None and cache is not None and pool is not None
        store.touch_session(seq.session_hash)
        reused = match.reused if match.snapshot is not None else 0
        # A capture within `near` tokens of another snapshot of this prompt (the restored one,
        # or the tail over a branch point) is skipped: it would save little and cost a split.
        near = self.snapshot_min_gap_tokens
        if near is None:
            near = NEAR_BLOCKS * self.block_size
        floor = reused + near if reused else 0
        tail = self.prefill_tail_split(tokens)
        seq.tail_checkpoint_tokens = tail if tail is not None and tail > floor else None
        branch = match.kv_tokens
        keep = floor < branch < len(tokens) and (
            seq.tail_checkpoint_tokens is None or abs(seq.tail_checkpoint_tokens - branch) > near
        )
        seq.ssm_branch_tokens = branch if keep else None
        if match.snapshot is None:
            store.stats.misses[cache.miss_cause(tokens, seq.adapter_id, match)] += 1
            return 0
        slot = seq.ssm_slot_idx()
        assert slot is not None
        blocks = [node.block for node in match.nodes]
        self.block_pool.incref(blocks)
        seq.block_table = blocks
        cache.touch(match.nodes)
        store.touch(match.snapshot, seq.session_hash)
        match.snapshot.hits += 1
        store.restore(match.snapshot, pool, slot)
        seq.adopt_cached_prefix(tokens, reused, reused, len(blocks))
        seq.marconi_skip_to = reused
        store.stats.hits += 1
        store.stats.hit_tokens += reused
        store.stats.unusable_kv_tokens += match.kv_tokens - reused
        return reused

    # ------------------------------------------------------------------ captures

    def _capture_after_forward(self, rows: Sequence[ForwardRow]) -> None:
        """After a forward's advance: snapshot prefill rows that reached a capture point and
        decode rows (one committed token) that reached a block boundary."""
        if self.snapshots is None:
            return
        for row in rows:
            seq = row.seq
            if row.prefill:
                if seq.seq_len == seq.tail_checkpoint_tokens:
                    self._capture_published(seq, "tail")
                elif seq.seq_len == seq.ssm_branch_tokens:
                    self._capture_published(seq, "branch")
            elif len(row.tokens) == 1:
                self.decode_marconi_checkpoint(seq)

    def _capture_published(self, seq: SequenceState, origin: str) -> None:
        """Index the sequence's blocks up to `seq_len` and snapshot its state on that node."""
        store, cache, pool = self.snapshots, self.prefix_cache, self.ssm_pool
        assert store is not None and cache is not None and pool is not None
        at = seq.seq_len
        prefix = seq.tokens[:at]
        cache.insert(prefix, seq.block_table, seq.adapter_id)
        node = cache.node_at(prefix, seq.adapter_id)
        assert node is not None
        if node.snapshot is not None:
            store.touch(node.snapshot, seq.session_hash)
            store.stats.captures_deduplicated += 1
            return
        snap = store.acquire(at, origin, seq.session_hash)
        if snap is None:
            return
        slot = seq.ssm_slot_idx()
        assert slot is not None
        store.save(snap, pool, slot, at)
        store.publish(snap, node)

    def decode_marconi_checkpoint(self, seq: SequenceState) -> None:
        """On a block boundary, copy the committed live state into the sequence's private
        decode track (taking a slot for it on its first boundary)."""
        store, pool = self.snapshots, self.ssm_pool
        if store is None or pool is None or seq.seq_len == 0 or seq.seq_len % self.block_size:
            return
        slot = seq.ssm_slot_idx()
        if slot is None or pool.num_tokens[slot] != seq.seq_len:
            return
        track = seq.ssm_track
        if track is None:
            track = store.acquire(seq.seq_len, "decode", seq.session_hash, private=True)
            if track is None:
                return
            seq.ssm_track = track
        store.save(track, pool, slot, seq.seq_len)
        seq.last_decode_ckpt_block = seq.seq_len // self.block_size

    def _publish_track(self, seq: SequenceState, valid: int) -> None:
        """`cache_sequence` on a hybrid model (after the blocks were inserted): publish the
        decode track on its node when its tokens are all indexed, else release it."""
        track: Snapshot | None = seq.ssm_track
        store, cache = self.snapshots, self.prefix_cache
        if track is None or store is None or cache is None:
            return
        seq.ssm_track = None
        node = cache.node_at(seq.tokens[: track.tokens], seq.adapter_id)
        if track.tokens <= valid and node is not None and node.snapshot is None:
            store.publish(track, node)
            return
        if node is not None and node.snapshot is not None:
            store.stats.captures_deduplicated += 1
        store.release(track)

    def _release_track(self, seq: SequenceState) -> None:
        track: Snapshot | None = seq.ssm_track
        seq.ssm_track = None
        seq.tail_checkpoint_tokens = seq.ssm_branch_tokens = None
        if track is not None and self.snapshots is not None:
            self.snapshots.release(track)

    # ------------------------------------------------------------------ reporting

    def ssm_snapshot_occupancy(self) -> tuple[int, int] | None:
        """(slots used, slots total) of the snapshot store; None without one."""
        if self.snapshots is None:
            return None
        return self.snapshots.num_used(), self.snapshots.num_slots

    def snapshot_stats(self) -> dict[str, int]:
        store = self.snapshots
        if store is None:
            return {}
        s = store.stats
        out = {
            "ssm_snapshot_slots": store.num_slots,
            "ssm_snapshot_slots_used": store.num_used(),
            "ssm_snapshot_private": store.num_private(),
            "ssm_snapshot_bytes_per_slot": store.bytes_per_snapshot,
            "ssm_snapshot_bytes_used": store.num_used() * store.bytes_per_snapshot,
            "ssm_snapshot_captures": s.captures,
            "ssm_snapshot_captures_skipped": s.captures_skipped,
            "ssm_snapshot_captures_deduplicated": s.captures_deduplicated,
            "ssm_snapshot_evictions": s.evictions,
            "ssm_snapshot_released_with_kv": s.released_with_kv,
            "ssm_snapshot_hits": s.hits,
            "ssm_snapshot_hit_tokens": s.hit_tokens,
            "ssm_snapshot_unusable_kv_tokens": s.unusable_kv_tokens,
        }
        for cause, n in s.misses.items():
            out[f"ssm_snapshot_miss_{cause}"] = n
        return out
