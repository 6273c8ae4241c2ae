"""High-speed swap's host side: the KV of a long sequence's older blocks, moved out of the
device pool so that a sequence only keeps its first block (the attention sink) and its newest
`window` blocks resident; attention reads the rest from here, layer by layer.

Owner: cache. `HostKvPool` stores blocks (every layer's K and V of one device block) under a
host id; the model engine decides what to move and marks a moved block in the sequence's
block table as `host_entry(id)` (a negative number), which `paged_attention` resolves here.

Invariants:
- A host id is held by exactly one sequence's table entry; `free` returns it, and the pool
  grows (doubling) rather than refusing, within host memory.
- `layer_tensors(k_cache)` finds a layer's host tensors by the device K tensor it mirrors, so
  the attention op needs no layer index.
- A block is copied bit for bit: attention over a host block computes what it would over the
  device block.
"""

from __future__ import annotations

import torch

from metrale.cache.kv_cache import PagedKVCache


def host_entry(host_id: int) -> int:
    """The block-table entry of a block kept at `host_id` (negative: never a device block)."""
    return -(host_id + 1)


def host_id_of(entry: int) -> int:
    return -entry - 1


class HostKvPool:
    def __init__(self, kv: PagedKVCache, initial_blocks: int = 16) -> None:
        self.kv = kv
        self.capacity = initial_blocks
        shape = (initial_blocks, kv.block_size, kv.num_kv_heads, kv.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=kv.dtype), torch.empty(shape, dtype=kv.dtype))
            for _ in kv.layers
        ]
        self._index = {k.data_ptr(): i for i, (k, _) in enumerate(kv.layers)}
        self._free = list(range(initial_blocks - 1, -1, -1))
        #: Blocks moved to the host, and blocks read back by attention (per layer read).
        self.stored_blocks = 0
        self.held = 0

    def _grow(self) -> None:
        old = self.capacity
        self.capacity *= 2
        grown = []
        for k, v in self.layers:
            nk = torch.empty((self.capacity, *k.shape[1:]), dtype=k.dtype)
            nv = torch.empty((self.capacity, *v.shape[1:]), dtype=v.dtype)
            nk[:old].copy_(k)
            nv[:old].copy_(v)
            grown.append((nk, nv))
        self.layers = grown
        self._free.extend(range(self.capacity - 1, old - 1, -1))

    def store(self, device_block: int) -> int:
        """Copy `device_block` of every layer here; returns its host id."""
        if not self._free:
            self._grow()
        host = self._free.pop()
        for (hk, hv), (k, v) in zip(self.layers, self.kv.layers, strict=True):
            hk[host].copy_(k[device_block])
            hv[host].copy_(v[device_block])
        self.stored_blocks += 1
        self.held += 1
        return host

    def free(self, host_ids: list[int]) -> None:
        self._free.extend(host_ids)
        self.held -= len(host_ids)

    def layer_tensors(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[self._index[k_cache.data_ptr()]]
