"""The KV block pool: reference-counted physical blocks with a free list.

Owner: cache. The model engine allocates blocks for sequences through it; the prefix cache
holds its own references on the blocks it indexes.

Invariants:
- Block 0 is the null block: never allocated, never freed; padded rows point at it.
- A block is on the free list exactly when its reference count is 0.
- `free_count + blocks with refcount > 0 == num_blocks - 1` at all times.
- Decrementing a block at count 0 is a bug and raises, so double frees surface at once.
- `blocks_for` is the one ceiling division of tokens by the block size: every count of the
  blocks a number of tokens occupies (scheduler, model engine, start-up sizing) calls it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from metrale.errors import KVCacheExhausted

NULL_BLOCK = 0


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `tokens` tokens (a ceiling division)."""
    return -(-tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a KV pool needs at least 2 blocks (1 null + 1 usable), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks with one reference each; all or nothing."""
        if n > len(self._free):
            raise KVCacheExhausted(
                f"KV cache exhausted: {n} blocks requested, {len(self._free)} free "
                f"of {self.num_usable}"
            )
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if b == NULL_BLOCK or self._refs[b] == 0:
                raise RuntimeError(f"incref of block {b}, which is not allocated")
            self._refs[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        freed = []
        for b in blocks:
            if b == NULL_BLOCK or self._refs[b] <= 0:
                raise RuntimeError(f"decref of block {b}, which holds no reference (double free)")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    def check(self) -> None:
        """Verify the free-list invariant; raises AssertionError with details if broken."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert NULL_BLOCK not in free, "the null block is on the free list"
        for b in range(1, self.num_blocks):
            assert (self._refs[b] == 0) == (b in free), f"block {b}: refs {self._refs[b]}"
