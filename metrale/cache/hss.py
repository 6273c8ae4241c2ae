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
- On CUDA the host tensors are pinned and `store` copies asynchronously on the current stream
  (the device block may be freed at once: whatever overwrites it runs after the copy). The
  CUDA attention kernels read device blocks only, so a forward there carries an `HssStaging`
  (`staging`): per layer, each sequence's blocks (resident ones by a device copy, host ones by
  one DMA per run of consecutive host ids) are gathered into one scratch cache in table
  order, and attention runs over that with the staging's tables. The scratch is one pair of
  tensors reused by every layer, sized for the forward's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from metrale.cache.block_pool import blocks_for
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
        self.cuda = kv.layers[0][0].device.type == "cuda"
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self._empty(initial_blocks), self._empty(initial_blocks)) for _ in kv.layers
        ]
        self._index = {k.data_ptr(): i for i, (k, _) in enumerate(kv.layers)}
        self._free = list(range(initial_blocks - 1, -1, -1))
        #: Blocks moved to the host, and blocks read back by attention (per layer read).
        self.stored_blocks = 0
        self.held = 0
        #: Host-to-device copies `HssStaging.stage` issued (one per run of host blocks).
        self.host_block_reads = 0

    def _empty(self, blocks: int) -> torch.Tensor:
        kv = self.kv
        shape = (blocks, kv.block_size, kv.num_kv_heads, kv.head_dim)
        return torch.empty(shape, dtype=kv.dtype, pin_memory=self.cuda)

    def _grow(self) -> None:
        if self.cuda:  # copies into (and out of) the old tensors may still be in flight
            torch.cuda.current_stream().synchronize()
        old = self.capacity
        self.capacity *= 2
        grown = []
        for k, v in self.layers:
            nk, nv = self._empty(self.capacity), self._empty(self.capacity)
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
            hk[host].copy_(k[device_block], non_blocking=self.cuda)
            hv[host].copy_(v[device_block], non_blocking=self.cuda)
        self.stored_blocks += 1
        self.held += 1
        return host

    def free(self, host_ids: list[int]) -> None:
        self._free.extend(host_ids)
        self.held -= len(host_ids)

    def layer_tensors(self, k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[self._index[k_cache.data_ptr()]]

    def staging(
        self, tables: list[list[int]], seq_lens: list[int], device: torch.device
    ) -> HssStaging:
        """The per-layer gather plan of one forward whose sequence `b` attends to its first
        `seq_lens[b]` positions through `tables[b]` (entries < 0 are host blocks)."""
        bs = self.kv.block_size
        width = max((blocks_for(n, bs) for n in seq_lens), default=1)
        scratch_tables = torch.zeros((len(tables), max(width, 1)), dtype=torch.int32)
        dev_src: list[int] = []
        dev_dst: list[int] = []
        runs: list[list[int]] = []  # [first host id, first scratch block, blocks]
        next_block = 1  # scratch block 0 stays the null block of padded table entries
        for b, (table, n) in enumerate(zip(tables, seq_lens, strict=True)):
            used = table[: blocks_for(n, bs)]
            for i, entry in enumerate(used):
                scratch_tables[b, i] = next_block + i
                if entry >= 0:
                    dev_src.append(entry)
                    dev_dst.append(next_block + i)
                    continue
                host = host_id_of(entry)
                last = runs[-1] if runs else None
                if (
                    last is not None
                    and last[0] + last[2] == host
                    and last[1] + last[2] == next_block + i
                ):
                    last[2] += 1
                else:
                    runs.append([host, next_block + i, 1])
            next_block += len(used)
        ids = torch.tensor([*dev_src, *dev_dst], dtype=torch.long).to(device, non_blocking=True)
        shape = (next_block, self.kv.block_size, self.kv.num_kv_heads, self.kv.head_dim)
        return HssStaging(
            pool=self,
            tables=scratch_tables.to(device, non_blocking=True),
            dev_src=ids[: len(dev_src)],
            dev_dst=ids[len(dev_src) :],
            host_runs=[(h, d, n) for h, d, n in runs],
            scratch=(
                torch.empty(shape, dtype=self.kv.dtype, device=device),
                torch.empty(shape, dtype=self.kv.dtype, device=device),
            ),
        )


@dataclass
class HssStaging:
    """One CUDA forward's high-speed-swap gather: every sequence's blocks in table order in
    one scratch cache (`tables` index it), filled layer by layer by `stage`."""

    pool: HostKvPool
    tables: torch.Tensor
    dev_src: torch.Tensor
    dev_dst: torch.Tensor
    #: (first host id, first scratch block, blocks) of each run of consecutive host blocks.
    host_runs: list[tuple[int, int, int]]
    scratch: tuple[torch.Tensor, torch.Tensor]

    def stage(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The scratch caches holding this layer's blocks, and `meta` (an
        `AttentionMetadata`, typed loosely: `kernels` is not below `cache`) reading them."""
        host_k, host_v = self.pool.layer_tensors(k_cache)
        for cache, host, scratch in (
            (k_cache, host_k, self.scratch[0]),
            (v_cache, host_v, self.scratch[1]),
        ):
            if self.dev_src.numel():
                scratch.index_copy_(0, self.dev_dst, cache.index_select(0, self.dev_src))
            for first, at, n in self.host_runs:
                scratch[at : at + n].copy_(host[first : first + n], non_blocking=True)
        self.pool.host_block_reads += len(self.host_runs)
        return (
            self.scratch[0],
            self.scratch[1],
            replace(meta, block_tables=self.tables, host_kv=None),
        )
