"""The radix prefix cache: a tree over full KV blocks so a new prompt reuses the KV of every
block-aligned prefix it shares with earlier sequences.

Owner: cache. `TransformerModel` owns one and calls it from `lookup_prefix`, `cache_sequence`
and the reclaim methods.

Structure: one root per adapter id (adapters never share blocks). Each non-root node holds one
physical block and is keyed in its parent by the block's token chunk, so a node is reachable
only through the exact prefix that produced its KV.

Reference counting rides on the block pool: the tree holds one pool reference per node, and
each sequence whose `block_table` contains a cached block holds its own. So a node's block is
"cache-only" exactly when its pool count is 1, and only then may it be evicted.

Hybrid models (a `SsmSnapshotStore` is given): a node may also hold the recurrent-state
snapshot taken when a sequence had computed exactly the node's path (`RadixNode.snapshot`), and
a match reuses KV only up to the deepest node holding one, strictly below the prompt's end (the
state after token N cannot be rewound, and the last token's logits need the state before it):
the KV matched past it is recomputed, and no block is ever copied.

Invariants:
- Only blocks whose KV is fully written (`kv_valid_tokens`) are inserted.
- Evicting a node's KV releases its snapshot with it (a snapshot without its KV is useless).
- A lookup never returns all of a prompt: the last token is always recomputed so its logits
  exist. When every token matched, the last matched block is copied (copy-on-write) into a
  private block and only its final token is recomputed.
- Eviction frees least-recently-used leaves nobody references; a protected path (the prefix
  a prompt is about to reuse) is never evicted for that prompt. `on_evict` sees each evicted
  node while its block still holds the KV (the lower tiers keep a copy: `kv_tiers.py`).
- pool free + cache-only blocks + blocks held by sequences == usable blocks, always.
- Every leaf of the tree has an entry in the eviction heap carrying its current
  `last_access` or an older one (so eviction never walks the tree: with a full cache of
  16k blocks the walk took milliseconds per allocation, and a server slowed as its cache
  filled).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from metrale.cache.block_pool import BlockPool
from metrale.cache.ssm_snapshots import Snapshot, SsmSnapshotStore

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RadixNode:
    block: int
    chunk: tuple[int, ...]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    last_access: int = 0
    #: Roots only: the namespace (adapter id / tenant key) the tree below belongs to.
    namespace: int = 0
    #: Hybrid models: the recurrent-state snapshot after exactly this node's path, or None.
    snapshot: Snapshot | None = None
    #: A snapshot here was evicted under pool pressure (the miss-cause metric).
    snapshot_evicted: bool = False
    #: False once evicted (its entries in the eviction heap are then stale).
    in_tree: bool = True


@dataclass
class PrefixCacheStats:
    """Counters; they only ever grow (except `cached_blocks`, a gauge). Query and hit counts
    live with the scheduler, which makes the queries."""

    evicted_blocks: int = 0
    inserted_blocks: int = 0
    cached_blocks: int = 0


@dataclass
class PrefixMatch:
    """What a lookup would reuse: `nodes` matched full blocks, `reused` tokens of KV kept."""

    nodes: list[RadixNode]
    reused: int
    #: The last matched block must be copied before its final token is recomputed.
    copy_last: bool
    #: Hybrid models: the snapshot restoring the state after `reused` tokens (None: none).
    snapshot: Snapshot | None = None
    #: Hybrid models: tokens of KV matched (full blocks), which may exceed `reused`.
    kv_tokens: int = 0


class RadixPrefixCache:
    def __init__(
        self, pool: BlockPool, block_size: int, snapshots: SsmSnapshotStore | None = None
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.snapshots = snapshots
        if snapshots is not None:
            snapshots.on_evict = _mark_evicted
        self.roots: dict[int, RadixNode] = {}
        #: Called with each node about to be evicted, its block still intact (the KV tiers
        #: offload it there).
        self.on_evict: Callable[[RadixNode], None] | None = None
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)
        #: Eviction candidates: `(last_access when pushed, order, node)` for every node that
        #: became a leaf (inserted as one, or its last child evicted). Entries go stale (the
        #: node was touched since, got children, was evicted) and are checked when popped,
        #: so an eviction costs O(k log n) for k popped entries, not a walk of the tree.
        self._leaves: list[tuple[int, int, RadixNode]] = []
        self._order = itertools.count()

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int], adapter_id: int) -> PrefixMatch:
        """The reusable prefix of `tokens`; takes no references and touches no LRU state."""
        nodes = self._path(tokens, adapter_id)
        matched = len(nodes) * self.block_size
        if self.snapshots is not None:
            return self._match_hybrid(nodes, len(tokens))
        if matched == 0:
            return PrefixMatch([], 0, False)
        if matched == len(tokens):
            return PrefixMatch(nodes, matched - 1, True)
        return PrefixMatch(nodes, matched, False)

    def _match_hybrid(self, nodes: list[RadixNode], num_tokens: int) -> PrefixMatch:
        """Cut a KV match back to its deepest snapshot strictly below the prompt's end."""
        bs = self.block_size
        best = 0
        for i, node in enumerate(nodes):
            if (i + 1) * bs >= num_tokens:
                break
            if node.snapshot is not None:
                best = i + 1
        kept = nodes[:best]
        snap = kept[-1].snapshot if kept else None
        return PrefixMatch(kept, best * bs, False, snapshot=snap, kv_tokens=len(nodes) * bs)

    def miss_cause(self, tokens: Sequence[int], adapter_id: int, match: PrefixMatch) -> str:
        """Why a hybrid lookup reused nothing: "cold" (no KV matched anywhere),
        "no_snapshot" (KV matched, never snapshotted on the path), "evicted" (a snapshot on
        the path was evicted under pressure), "wrong_adapter" (another namespace holds a
        snapshot of this prefix)."""
        if match.kv_tokens:
            path = self._path(tokens, adapter_id)
            if any(node.snapshot_evicted for node in path):
                return "evicted"
            return "no_snapshot"
        for other, _root in self.roots.items():
            if other != adapter_id and any(
                node.snapshot is not None for node in self._path(tokens[:-1], other)
            ):
                return "wrong_adapter"
        return "cold"

    def _path(self, tokens: Sequence[int], adapter_id: int) -> list[RadixNode]:
        """The nodes of `adapter_id`'s tree along `tokens`' whole blocks, as deep as they
        match."""
        bs = self.block_size
        nodes: list[RadixNode] = []
        node = self.roots.get(adapter_id)
        while node is not None and (len(nodes) + 1) * bs <= len(tokens):
            start = len(nodes) * bs
            node = node.children.get(tuple(tokens[start : start + bs]))
            if node is not None:
                nodes.append(node)
        return nodes

    def node_at(self, tokens: Sequence[int], adapter_id: int) -> RadixNode | None:
        """The node whose path is exactly `tokens` (a whole number of blocks), or None."""
        if not tokens or len(tokens) % self.block_size:
            return None
        path = self._path(tokens, adapter_id)
        return path[-1] if len(path) * self.block_size == len(tokens) else None

    def touch(self, nodes: Sequence[RadixNode]) -> None:
        now = next(self._clock)
        for node in nodes:
            node.last_access = now

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], adapter_id: int) -> int:
        """Index the full blocks of `tokens` (whose KV is in `blocks`, in order); returns how
        many new nodes were created. Existing nodes keep their block; the sequence's duplicate
        is released with the sequence."""
        bs = self.block_size
        n = min(len(tokens) // bs, len(blocks))
        node = self.roots.get(adapter_id)
        if node is None:
            node = self.roots[adapter_id] = RadixNode(0, (), None, namespace=adapter_id)
        path: list[RadixNode] = []
        created = 0
        for i in range(n):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            child = node.children.get(chunk)
            if child is None:
                block = blocks[i]
                self.pool.incref([block])
                child = RadixNode(block=block, chunk=chunk, parent=node)
                node.children[chunk] = child
                created += 1
            path.append(child)
            node = child
        self.touch(path)
        if created:  # the new nodes end the path: only its last one is a leaf
            self._push_leaf(path[-1])
        self.stats.inserted_blocks += created
        self.stats.cached_blocks += created
        return created

    # ---------------------------------------------------------------- eviction

    def _push_leaf(self, node: RadixNode) -> None:
        heapq.heappush(self._leaves, (node.last_access, next(self._order), node))

    def _evictable(self, node: RadixNode, protected: set[int]) -> bool:
        return (
            not node.children
            and node.parent is not None
            and node.block not in protected
            and self.pool.ref_count(node.block) == 1
        )

    def evict(self, n: int, protected: set[int] | None = None) -> int:
        """Free up to `n` blocks held only by the cache, least recently used leaves first.

        Pops the candidate heap in `last_access` order: an entry whose node was evicted or
        has children is dropped (a node is pushed again when it becomes a leaf), one whose
        node was touched since is pushed back under its new time, and a leaf in use (a
        sequence holds its block) or protected is set aside and pushed back afterwards."""
        protected = protected or set()
        heap = self._leaves
        aside: list[tuple[int, int, RadixNode]] = []
        freed = 0
        while heap and freed < n:
            entry = heapq.heappop(heap)
            access, _, node = entry
            if not node.in_tree or node.children:
                continue
            if access != node.last_access:
                self._push_leaf(node)
                continue
            if not self._evictable(node, protected):
                aside.append(entry)
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.chunk]
            node.in_tree = False
            if self.on_evict is not None:
                self.on_evict(node)
            if node.snapshot is not None and self.snapshots is not None:
                self.snapshots.release(node.snapshot)
                self.snapshots.stats.released_with_kv += 1
            self.pool.decref([node.block])
            freed += 1
            if parent.parent is not None and not parent.children:
                self._push_leaf(parent)
        for entry in aside:
            heapq.heappush(heap, entry)
        self.stats.evicted_blocks += freed
        self.stats.cached_blocks -= freed
        return freed

    @staticmethod
    def path_of(node: RadixNode) -> tuple[int, list[int]]:
        """(namespace, tokens from the start of the prompt to the end of `node`'s block)."""
        chunks = []
        while node.parent is not None:
            chunks.append(node.chunk)
            node = node.parent
        return node.namespace, [t for chunk in reversed(chunks) for t in chunk]

    def protected_blocks(self, tokens: Sequence[int], adapter_id: int) -> set[int]:
        return {node.block for node in self.match(tokens, adapter_id).nodes}

    # ---------------------------------------------------------------- checking

    def cached_block_ids(self) -> list[int]:
        out = []
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node.block)
            stack.extend(node.children.values())
        return out

    def cache_only_blocks(self) -> int:
        return sum(1 for b in self.cached_block_ids() if self.pool.ref_count(b) == 1)


def _mark_evicted(node: RadixNode) -> None:
    node.snapshot_evicted = True
