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

Invariants:
- Only blocks whose KV is fully written (`kv_valid_tokens`) are inserted.
- A lookup never returns all of a prompt: the last token is always recomputed so its logits
  exist. When every token matched, the last matched block is copied (copy-on-write) into a
  private block and only its final token is recomputed.
- Eviction frees least-recently-used leaves nobody references; a protected path (the prefix
  a prompt is about to reuse) is never evicted for that prompt. `on_evict` sees each evicted
  node while its block still holds the KV (the lower tiers keep a copy: `kv_tiers.py`).
- pool free + cache-only blocks + blocks held by sequences == usable blocks, always.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from metrale.cache.block_pool import BlockPool

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


class RadixPrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.roots: dict[int, RadixNode] = {}
        #: Called with each node about to be evicted, its block still intact (the KV tiers
        #: offload it there).
        self.on_evict: Callable[[RadixNode], None] | None = None
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int], adapter_id: int) -> PrefixMatch:
        """The reusable prefix of `tokens`; takes no references and touches no LRU state."""
        root = self.roots.get(adapter_id)
        nodes: list[RadixNode] = []
        bs = self.block_size
        node = root
        while node is not None and (len(nodes) + 1) * bs <= len(tokens):
            start = len(nodes) * bs
            node = node.children.get(tuple(tokens[start : start + bs]))
            if node is not None:
                nodes.append(node)
        matched = len(nodes) * bs
        if matched == 0:
            return PrefixMatch([], 0, False)
        if matched == len(tokens):
            return PrefixMatch(nodes, matched - 1, True)
        return PrefixMatch(nodes, matched, False)

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
        self.stats.inserted_blocks += created
        self.stats.cached_blocks += created
        return created

    # ---------------------------------------------------------------- eviction

    def _evictable_leaves(self, protected: set[int]) -> list[tuple[int, int, RadixNode]]:
        heap: list[tuple[int, int, RadixNode]] = []
        order = itertools.count()
        stack = [c for root in self.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif self._evictable(node, protected):
                heap.append((node.last_access, next(order), node))
        heapq.heapify(heap)
        return heap

    def _evictable(self, node: RadixNode, protected: set[int]) -> bool:
        return (
            not node.children
            and node.parent is not None
            and node.block not in protected
            and self.pool.ref_count(node.block) == 1
        )

    def evict(self, n: int, protected: set[int] | None = None) -> int:
        """Free up to `n` blocks held only by the cache, least recently used leaves first."""
        protected = protected or set()
        heap = self._evictable_leaves(protected)
        order = itertools.count(len(heap))
        freed = 0
        while heap and freed < n:
            _, _, node = heapq.heappop(heap)
            if not self._evictable(node, protected):
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[node.chunk]
            if self.on_evict is not None:
                self.on_evict(node)
            self.pool.decref([node.block])
            freed += 1
            if parent.parent is not None and self._evictable(parent, protected):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
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
