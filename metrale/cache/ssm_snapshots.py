"""The SSM snapshot store: copies of a hybrid model's recurrent state (conv window and SSM
state of every recurrent layer) at block-aligned token positions, so a prefix-cache hit on a
hybrid model can restore the state its KV prefix needs (Marconi-style prefix caching).

Owner: cache. One per hybrid `TransformerModel` with prefix caching on (`snapshots`); the
radix tree (`radix.py`) indexes published snapshots by node (`RadixNode.snapshot`), the model
engine (`model_engine/ssm_prefix.py`) takes and restores them.

Structure: a bounded pool of its own (`SsmSlotPool` tensors, `num_slots` slots, on the model's
device: device memory on CUDA, host memory on the CPU). A snapshot is either *published*
(attached to the radix node whose last block ends at `tokens`: it is the state after exactly
the node's path, in the node's namespace, so it is reachable only through that exact prefix
under that adapter / tenant) or *private* (a live sequence's decode track, refreshed in place
at each block boundary of its decode and published when the sequence is cached).

Admission and eviction (Marconi): when the pool is full, a new snapshot takes the slot of the
published snapshot with the lowest utility `norm(recency) + alpha * norm(flops saved / bytes)`
(min-max normalised over the candidates); flops saved is what a hit there saves over the next
shallower snapshot on its path (linear layers per token plus attention's quadratic term), and
recency is the later of the snapshot's last use and its session's last activity, so the
snapshots of a live conversation are kept. A newcomer never evicts a snapshot with higher
utility than its own; private tracks are never evicted, and hold at most half the pool.

Invariants:
- slots used == published + private (+ acquired, not yet published) snapshots; used + free ==
  `num_slots`, always. Only published snapshots are ever evicted.
- A snapshot's state is a bit copy of a live slot's state taken right after a forward whose
  sequence covered exactly `tokens` tokens (copies are device-side `copy_`, no host sync).
- A published snapshot belongs to exactly one node, and a node holds at most one; evicting the
  node's KV (radix eviction) releases its snapshot.
- `release` returns a slot exactly once; releasing an already released snapshot does nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from metrale.cache.ssm_pool import SlotGuard, SsmLayerSpec, SsmSlotPool

#: Why a hybrid prefix lookup reused nothing (`SnapshotStats.misses`).
MISS_CAUSES = ("cold", "no_snapshot", "evicted", "wrong_adapter")


@dataclass(frozen=True)
class SnapshotCost:
    """What recomputing tokens costs, to weigh a snapshot's worth (Marconi's flop efficiency):
    `linear` flops per token (2 x parameters) and `attention` flops per token per context
    position (summed over attention layers)."""

    linear: float
    attention: float

    def flops(self, start: int, end: int) -> float:
        """Flops to recompute positions `start..end` with `start` tokens already cached."""
        n = end - start
        return self.linear * n + self.attention * (end * end - start * start) / 2.0


@dataclass(eq=False)
class Snapshot:
    guard: SlotGuard
    #: Tokens of the sequence the state covers (block-aligned).
    tokens: int
    #: "tail" (two-phase prefill), "branch" (a KV match point), "decode" (a decode track).
    origin: str
    session: int
    last_access: int = 0
    #: The radix node it is published on; None while private.
    node: Any = None
    hits: int = 0

    @property
    def slot(self) -> int:
        idx = self.guard.idx()
        if idx is None:
            raise ValueError("the snapshot has been released")
        return idx


@dataclass
class SnapshotStats:
    """Counters (only ever grow) of the snapshot store and of hybrid prefix lookups."""

    captures: int = 0
    #: Captures skipped: the pool was full of higher-value or private snapshots.
    captures_skipped: int = 0
    #: Captures not needed: the node already held a snapshot.
    captures_deduplicated: int = 0
    evictions: int = 0
    #: Snapshots released because the radix tree evicted their node's KV.
    released_with_kv: int = 0
    hits: int = 0
    hit_tokens: int = 0
    #: KV tokens a lookup matched past its deepest usable snapshot (recomputed).
    unusable_kv_tokens: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_CAUSES, 0))


class SsmSnapshotStore:
    def __init__(
        self,
        specs: list[SsmLayerSpec],
        num_slots: int,
        conv_dtype: torch.dtype,
        device: torch.device,
        cost: SnapshotCost,
        alpha: float = 1.0,
    ) -> None:
        # The pool refuses fewer than one slot (`SsmSlotPool` holds that rule).
        self.pool = SsmSlotPool(specs, num_slots, conv_dtype, device)
        self.num_slots = num_slots
        self.cost = cost
        self.alpha = alpha
        self.bytes_per_snapshot = SsmSlotPool.bytes_for(specs, 1, conv_dtype)
        self.stats = SnapshotStats()
        self._clock = itertools.count(1)
        self._published: set[Snapshot] = set()
        self._private: set[Snapshot] = set()
        #: Acquired for a node, not yet published (between `acquire` and `publish`).
        self._pending: set[Snapshot] = set()
        #: session -> logical time of its last lookup or capture.
        self._session_active: dict[int, int] = {}
        #: Called with a node whose snapshot was evicted under pressure (the radix tree's
        #: `snapshot_evicted` mark, for the miss-cause metric).
        self.on_evict: Callable[[Any], None] | None = None

    # ------------------------------------------------------------------ accounting

    def num_used(self) -> int:
        return self.pool.num_allocated()

    def num_published(self) -> int:
        return len(self._published)

    def num_private(self) -> int:
        return len(self._private)

    def bytes_total(self) -> int:
        return self.pool.bytes_total()

    def check(self) -> None:
        """The accounting invariants (tests call it)."""
        held = len(self._published) + len(self._private) + len(self._pending)
        assert self.num_used() == held
        assert self.num_used() + self.pool.num_free() == self.num_slots
        for snap in self._published:
            assert snap.node is not None and snap.node.snapshot is snap

    # ------------------------------------------------------------------ state copies

    def save(self, snap: Snapshot, live: SsmSlotPool, live_slot: int, tokens: int) -> None:
        """Copy a live slot's state into `snap` (device-side copies)."""
        dst = snap.slot
        for (conv, ssm), (sconv, sssm) in zip(self.pool.layers, live.layers, strict=True):
            conv[dst].copy_(sconv[live_slot])
            ssm[dst].copy_(sssm[live_slot])
        snap.tokens = tokens
        self.pool.num_tokens[dst] = tokens
        self.stats.captures += 1

    def restore(self, snap: Snapshot, live: SsmSlotPool, live_slot: int) -> None:
        """Copy `snap` into a live slot, which then covers `snap.tokens` tokens."""
        src = snap.slot
        for (conv, ssm), (lconv, lssm) in zip(self.pool.layers, live.layers, strict=True):
            lconv[live_slot].copy_(conv[src])
            lssm[live_slot].copy_(ssm[src])
        live.num_tokens[live_slot] = snap.tokens

    # ------------------------------------------------------------------ admission, eviction

    def touch(self, snap: Snapshot, session: int) -> None:
        now = next(self._clock)
        snap.last_access = now
        self.touch_session(session, now)

    def touch_session(self, session: int, now: int | None = None) -> None:
        if session:
            self._session_active[session] = next(self._clock) if now is None else now

    def acquire(
        self, tokens: int, origin: str, session: int, private: bool = False
    ) -> Snapshot | None:
        """A slot for a new snapshot at `tokens`, evicting the published snapshot of lowest
        utility if the pool is full and it is worth less than the newcomer; None (counted)
        when nothing may be evicted."""
        if private and len(self._private) >= max(1, self.num_slots // 2):
            self.stats.captures_skipped += 1
            return None
        if self.pool.num_free() == 0 and not self._evict_one(tokens):
            self.stats.captures_skipped += 1
            return None
        snap = Snapshot(self.pool.allocate(), tokens, origin, session)
        self.touch(snap, session)
        (self._private if private else self._pending).add(snap)
        return snap

    def publish(self, snap: Snapshot, node: Any) -> None:
        """Attach a (private or fresh) snapshot to `node`, which must hold none."""
        if node.snapshot is not None:
            raise ValueError("the radix node already holds a snapshot")
        self._private.discard(snap)
        self._pending.discard(snap)
        self._published.add(snap)
        snap.node = node
        node.snapshot = snap
        node.snapshot_evicted = False

    def release(self, snap: Snapshot) -> None:
        """Return the snapshot's slot and detach it from its node (idempotent)."""
        self._private.discard(snap)
        self._pending.discard(snap)
        self._published.discard(snap)
        if snap.node is not None and snap.node.snapshot is snap:
            snap.node.snapshot = None
        snap.node = None
        snap.guard.release()

    def _utilities(self) -> list[tuple[float, int, Snapshot]]:
        cands = list(self._published)
        recency = [float(max(s.last_access, self._session_active.get(s.session, 0))) for s in cands]
        worth = [self._flops_saved(s) / self.bytes_per_snapshot for s in cands]
        return [
            (r + self.alpha * w, s.last_access, s)
            for r, w, s in zip(_norm(recency), _norm(worth), cands, strict=True)
        ]

    def _flops_saved(self, snap: Snapshot) -> float:
        """What a hit on `snap` saves over the next shallower snapshot on its path."""
        parent = 0
        node = snap.node.parent if snap.node is not None else None
        while node is not None:
            other = getattr(node, "snapshot", None)
            if other is not None:
                parent = other.tokens
                break
            node = node.parent
        return self.cost.flops(parent, snap.tokens)

    def _evict_one(self, tokens: int) -> bool:
        """Evict the lowest-utility published snapshot, unless a newcomer at `tokens` (most
        recent of all, so recency 1) would be worth less than it."""
        utilities = self._utilities()
        if not utilities:
            return False
        score, _, victim = min(utilities, key=lambda u: (u[0], u[1]))
        max_worth = max(self._flops_saved(s) for s in self._published) or 1.0
        newcomer = 1.0 + self.alpha * min(1.0, self.cost.flops(0, tokens) / max_worth)
        if newcomer < score:
            return False
        node = victim.node
        self.release(victim)
        self.stats.evictions += 1
        if node is not None and self.on_evict is not None:
            self.on_evict(node)
        return True

    def evict_all(self) -> int:
        """Release every published snapshot (tests, reclaiming everything)."""
        snaps = list(self._published)
        for snap in snaps:
            self.release(snap)
        return len(snaps)


def _norm(values: list[float]) -> list[float]:
    if not values:
        return []
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [0.0] * len(values)
    return [(v - lo) / (hi - lo) for v in values]
