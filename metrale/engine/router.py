"""`PrefixRouter`: which data-parallel replica a request goes to (pure policy, no processes).

Owner: engine. `ReplicatedEngine` (`replicas.py`) asks `choose` for every add and tells the
router what it sent where (`record`); the router never talks to a replica itself.

Policy. A prompt's full token blocks (`block_size` tokens each, the engine's KV block) are named
by chained hashes: block i's hash covers the request's prefix-cache namespace (adapter id and
`cache_namespace`, as `scheduler.sequence.prefix_namespace` keys the engine's cache) and every
token from the prompt's start to the block's end, so two prompts share a hash only where they
share that whole prefix in the same namespace. The router remembers, per replica, the block
hashes it sent there (a bounded LRU: `capacity` hashes; a match refreshes the blocks it used).
A request goes to the available replica holding its longest recorded prefix, unless that
replica's load (outstanding requests) exceeds the least loaded available replica's by more than
`load_margin`; then, and when no replica holds any of its blocks, it goes to the least loaded
one. Ties (equal matches, equal loads) go to the replica this router has sent the fewest
requests, then the lowest index.

Invariants:
- The record is approximate by design: a replica's own prefix cache decides the real hit (it
  may have evicted what the router remembers, or the router may have forgotten what it holds).
- `choose` never picks an unavailable replica, and raises `ValueError` when none is available
  (the caller says why to the client).
- `forget(replica)` drops everything recorded for a replica (it died or restarted: its cache
  is empty).
- No torch, no I/O: unit-testable in plain Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from metrale.scheduler.sequence import prefix_namespace

#: Default bound of each replica's record, in block hashes, when the caller gives none.
DEFAULT_CAPACITY = 65536
#: Default extra outstanding requests a prefix-holding replica may carry over the least loaded
#: one and still get the request.
DEFAULT_LOAD_MARGIN = 4


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    adapter_id: int = 0,
    cache_namespace: str | None = None,
) -> list[int]:
    """The chained hashes of `token_ids`' full blocks in the given prefix-cache namespace:
    hash i covers the namespace and tokens [0, (i + 1) * block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = hash(("metrale-dp", prefix_namespace(adapter_id, cache_namespace)))
    hashes = []
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hash((parent, tuple(token_ids[end - block_size : end])))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why (the why is counted per replica)."""

    replica: int
    #: Full blocks of the prompt the chosen replica was recorded to hold.
    matched_blocks: int
    #: "prefix": the longest recorded prefix won; "load": the least loaded replica (no
    #: prefix recorded anywhere, or the prefix holder was over the margin).
    reason: str


class PrefixRouter:
    """The prefix-aware, load-balanced choice of a replica (see the module docstring)."""

    def __init__(
        self,
        num_replicas: int,
        *,
        capacity: int = DEFAULT_CAPACITY,
        load_margin: int = DEFAULT_LOAD_MARGIN,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if load_margin < 0:
            raise ValueError(f"load_margin must be >= 0, got {load_margin}")
        self.num_replicas = num_replicas
        self.capacity = capacity
        self.load_margin = load_margin
        self._records: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        #: Requests routed to each replica since start.
        self.routed = [0] * num_replicas

    def matched_blocks(self, replica: int, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` `replica` is recorded to hold: the deepest
        recorded hash (chained, so it stands for its whole prefix)."""
        record = self._records[replica]
        for depth in range(len(hashes), 0, -1):
            if hashes[depth - 1] in record:
                return depth
        return 0

    def choose(
        self, hashes: Sequence[int], loads: Sequence[int], available: Sequence[bool]
    ) -> Decision:
        """The replica for a request whose prompt blocks hash to `hashes`, given each
        replica's outstanding requests (`loads`) and which replicas may take it."""
        if len(loads) != self.num_replicas or len(available) != self.num_replicas:
            raise ValueError("loads and available need one entry per replica")
        candidates = [i for i in range(self.num_replicas) if available[i]]
        if not candidates:
            raise ValueError("no replica is available")

        def lighter(i: int) -> tuple[int, int, int]:
            return (loads[i], self.routed[i], i)

        least = min(candidates, key=lighter)
        matches = {i: self.matched_blocks(i, hashes) for i in candidates} if hashes else {}
        best = max(matches.values(), default=0)
        if best > 0:
            holder = min((i for i in candidates if matches[i] == best), key=lighter)
            if loads[holder] - loads[least] <= self.load_margin:
                return Decision(holder, best, "prefix")
        return Decision(least, matches.get(least, 0), "load")

    def record(self, replica: int, hashes: Sequence[int]) -> None:
        """`replica` got a request with these block hashes: remember them (most recent last),
        dropping the least recently used past `capacity`."""
        self.routed[replica] += 1
        record = self._records[replica]
        for h in hashes:
            if h in record:
                record.move_to_end(h)
            else:
                record[h] = None
        while len(record) > self.capacity:
            record.popitem(last=False)

    def forget(self, replica: int) -> None:
        """Drop `replica`'s record (its cache is gone: it died or restarted)."""
        self._records[replica].clear()

    def recorded_blocks(self, replica: int) -> int:
        return len(self._records[replica])
