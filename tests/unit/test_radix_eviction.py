"""The radix cache's eviction keeps its rule (least recently used leaves nobody references,
a parent becoming a leaf in turn, protected blocks never) now that it pops a persistent heap
instead of walking the tree: over random inserts, lookups, sequences holding and releasing
blocks and evictions, every `evict` frees exactly the blocks a walk of the whole tree would
choose, and the pool's accounting holds."""

from __future__ import annotations

import random

from metrale.cache.block_pool import BlockPool
from metrale.cache.radix import RadixNode, RadixPrefixCache

BS = 2


def _walk_choice(cache: RadixPrefixCache, n: int, protected: set[int]) -> list[int]:
    """The blocks the old eviction would free: repeatedly the evictable leaf with the
    smallest `last_access` (the tree walked each time), its parent a candidate afterwards."""
    gone: set[int] = set()  # node ids treated as evicted
    chosen: list[int] = []

    def children(node: RadixNode) -> list[RadixNode]:
        return [c for c in node.children.values() if id(c) not in gone]

    def evictable(node: RadixNode) -> bool:
        return (
            not children(node)
            and node.parent is not None
            and node.block not in protected
            and cache.pool.ref_count(node.block) == 1
        )

    while len(chosen) < n:
        best = None
        stack = [c for root in cache.roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            if id(node) in gone:
                continue
            stack.extend(children(node))
            if evictable(node) and (best is None or node.last_access < best.last_access):
                best = node
        if best is None:
            break
        gone.add(id(best))
        chosen.append(best.block)
    return chosen


def test_eviction_matches_a_walk_of_the_tree() -> None:
    rng = random.Random(7)
    pool = BlockPool(200)
    cache = RadixPrefixCache(pool, BS)
    freed_blocks: list[int] = []
    cache.on_evict = lambda node: freed_blocks.append(node.block)
    held: list[list[int]] = []  # blocks each live "sequence" references
    prompts: list[list[int]] = []
    evictions = 0
    for _ in range(800):
        op = rng.random()
        if op < 0.45 and pool.num_free >= 8:
            # a sequence: reuse a cached prefix of an earlier prompt, then new blocks
            base = rng.choice(prompts) if prompts and rng.random() < 0.6 else []
            keep = base[: BS * rng.randint(0, len(base) // BS)]
            tokens = keep + [rng.randint(0, 3) for _ in range(BS * rng.randint(1, 4))]
            match = cache.match(tokens, 0)
            reused = [node.block for node in match.nodes][: match.reused // BS]
            pool.incref(reused)
            fresh = pool.allocate(len(tokens) // BS - len(reused))
            blocks = reused + fresh
            cache.touch(match.nodes)
            cache.insert(tokens, blocks, 0)
            held.append(blocks)
            prompts.append(tokens)
        elif op < 0.6 and prompts:
            # a repeated prompt: its cached path (a leaf among it) is used again
            tokens = rng.choice(prompts)
            cache.touch(cache._path(tokens, 0))
        elif op < 0.8 and held:
            pool.decref(held.pop(rng.randrange(len(held))))  # a sequence ends
        else:
            protected = set()
            if prompts and rng.random() < 0.5:
                protected = cache.protected_blocks(rng.choice(prompts), 0)
            want = rng.randint(1, 6)
            expected = _walk_choice(cache, want, protected)
            free_before = pool.num_free
            freed_blocks.clear()
            freed = cache.evict(want, protected)
            assert freed_blocks == expected  # the same blocks, in the same order
            assert freed == len(expected)
            assert pool.num_free - free_before == freed
            assert not protected & set(expected)
            evictions += freed
        pool.check()
    assert evictions > 50, "the sequence never exercised eviction"
    # drain: with every sequence gone, everything cached can go
    for blocks in held:
        pool.decref(blocks)
    cache.evict(10**6)
    assert pool.num_free == pool.num_usable
    assert cache.stats.cached_blocks == 0
