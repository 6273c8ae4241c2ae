"""The lower tiers of the prefix cache: host memory, then disk, for KV blocks the device pool
evicted. A block is found again by its *chain key*, so a later prompt with the same prefix
gets its KV back instead of recomputing it.

Owner: cache. `chain_keys` names blocks; `KvTiers` stores and finds them (`HostTier` in
front of an optional `DiskTier`). The model engine decides what to offload and restores
blocks into device blocks it allocates; this module only keeps bytes.

Invariants:
- A chain key is a digest of the namespace (adapter / tenant), the block size and every
  token from the start of the prompt to the end of the block, so a block is only ever found
  through the exact prefix (and namespace) that produced its KV, as in the radix tree.
- Each tier is LRU within its byte budget. A block leaving the host tier goes to the disk
  tier (when there is one); a block leaving the disk tier is gone. A block is in at most one
  tier at a time; `get` promotes it back to the front of the host tier.
- Disk files carry a header (magic, format version, the pool's fingerprint: model, dtype,
  block size, layer and head shapes) and a SHA-256 of the payload. At start the directory is
  indexed from headers (files of another fingerprint are skipped, never served); a payload
  whose checksum fails on read is deleted, counted and reported as a miss, with a warning.
- Writes to disk happen on a background thread (`flush` waits for them); a block is served
  from its host copy until its file is complete. `take_many` reads a restore's disk files on
  a pool of reader threads, and returns blocks in chain order up to the first miss.
- `stats` counts blocks and bytes per tier, hits and misses per tier, spills, corrupt files,
  and per tier the bytes restored into device blocks and the host wall time that took
  (`restore_bytes`, `restore_seconds`: the restore bandwidth; the caller times it).
- A payload is `bytes` or a `HostBlock`: a flat uint8 host tensor (pinned when the pool is on
  CUDA) that a device-to-host copy fills asynchronously. The host tier keeps either as given,
  so a block offloaded from a CUDA pool is never turned into Python bytes unless it goes to
  disk (`payload_bytes` waits for its copy first), and its restore is a DMA from that tensor.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: Disk file header: magic, version, fingerprint length; then the fingerprint, the payload's
#: SHA-256 and its length.
_MAGIC = b"MTLKV"
_VERSION = 1
_HEAD = struct.Struct("<5sHI")
_TAIL = struct.Struct("<32sQ")
_SUFFIX = ".kvb"
#: Threads reading (and checksumming) disk-tier files for one restore.
_DISK_READERS = 8


@dataclass
class HostBlock:
    """One block's K and V of every layer as a flat uint8 host tensor. `ready` is the CUDA
    event recorded after the device-to-host copy that fills `data` (None: already filled)."""

    data: torch.Tensor
    ready: torch.cuda.Event | None = None
    #: The pinned slab `data` is row `row` of (None: a tensor of its own), so a restore can
    #: copy runs of adjacent rows at once.
    slab: torch.Tensor | None = None
    row: int = 0

    def __len__(self) -> int:
        return self.data.numel()


#: What a tier keeps for one block.
Payload = bytes | HostBlock


def payload_bytes(payload: Payload) -> bytes:
    """The payload as bytes (a `HostBlock`'s copy is waited for first)."""
    if isinstance(payload, bytes):
        return payload
    if payload.ready is not None:
        payload.ready.synchronize()
    return payload.data.numpy().tobytes()


def chain_keys(tokens: Sequence[int], block_size: int, namespace: int) -> list[bytes]:
    """One key per full block of `tokens`: key `i` digests the namespace, the block size and
    tokens `[0, (i + 1) * block_size)` (a running hash, so the whole list costs one pass)."""
    h = hashlib.sha256(struct.pack("<qI", namespace, block_size))
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h.update(struct.pack(f"<{block_size}q", *tokens[start : start + block_size]))
        keys.append(h.copy().digest()[:20])
    return keys


@dataclass
class TierStats:
    blocks: int = 0
    bytes: int = 0
    hits: int = 0
    misses: int = 0
    #: Blocks that left this tier for a lower one (host) or were dropped (disk).
    evictions: int = 0
    #: Bytes brought back from this tier into device blocks, and the host wall time of
    #: finding, reading and writing them (`PagedKvLifecycle._restore_from_tiers` times it).
    restore_bytes: int = 0
    restore_seconds: float = 0.0


@dataclass
class TiersStats:
    host: TierStats = field(default_factory=TierStats)
    disk: TierStats = field(default_factory=TierStats)
    #: Disk files refused: a bad header or checksum (deleted), or another pool's fingerprint.
    corrupt: int = 0
    foreign: int = 0


class HostTier:
    """Blocks in host memory, LRU within `capacity` bytes."""

    def __init__(self, capacity: int, stats: TierStats) -> None:
        self.capacity = capacity
        self.stats = stats
        self.items: OrderedDict[bytes, Payload] = OrderedDict()

    def put(self, key: bytes, payload: Payload) -> list[tuple[bytes, Payload]]:
        """Store `payload`; returns the (key, payload) pairs pushed out to make room."""
        stale = self.items.pop(key, None)
        if stale is not None:  # a newer copy of the same block replaces it
            self.stats.bytes -= len(stale)
        out = []
        while self.items and self.stats.bytes + len(payload) > self.capacity:
            evicted, data = self.items.popitem(last=False)
            self.stats.bytes -= len(data)
            self.stats.evictions += 1
            out.append((evicted, data))
        if len(payload) > self.capacity:
            out.append((key, payload))
        else:
            self.items[key] = payload
            self.stats.bytes += len(payload)
        self.stats.blocks = len(self.items)
        return out

    def take(self, key: bytes) -> Payload | None:
        payload = self.items.pop(key, None)
        if payload is not None:
            self.stats.bytes -= len(payload)
            self.stats.blocks = len(self.items)
        return payload


class DiskTier:
    """Blocks as files under `directory`, LRU within `capacity` bytes, written in the
    background; survives a restart (see the module invariants)."""

    def __init__(self, directory: Path, capacity: int, fingerprint: bytes, stats: TiersStats):
        self.dir = directory
        self.capacity = capacity
        self.fingerprint = fingerprint
        self.all_stats = stats
        self.stats = stats.disk
        self.dir.mkdir(parents=True, exist_ok=True)
        #: key -> payload size, oldest first.
        self.index: OrderedDict[bytes, int] = OrderedDict()
        #: Payloads queued for writing (served from here until their file is complete).
        self.pending: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()
        #: Reads (and checksums) of `KvTiers.take_many`, several files at once.
        self._readers = ThreadPoolExecutor(
            max_workers=_DISK_READERS, thread_name_prefix="kv-disk-read"
        )

    # ----------------------------------------------------------------- files

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + _SUFFIX)

    def _header(self, payload: bytes) -> bytes:
        digest = hashlib.sha256(payload).digest()
        return (
            _HEAD.pack(_MAGIC, _VERSION, len(self.fingerprint))
            + self.fingerprint
            + _TAIL.pack(digest, len(payload))
        )

    def _read_header(self, f: object) -> tuple[bytes, bytes, int] | None:
        """(fingerprint, digest, payload length), or None for a file that is not ours."""
        read = f.read  # type: ignore[attr-defined]
        head = read(_HEAD.size)
        if len(head) != _HEAD.size:
            return None
        magic, version, flen = _HEAD.unpack(head)
        if magic != _MAGIC or version != _VERSION or flen > 4096:
            return None
        fingerprint = read(flen)
        tail = read(_TAIL.size)
        if len(fingerprint) != flen or len(tail) != _TAIL.size:
            return None
        digest, size = _TAIL.unpack(tail)
        return fingerprint, digest, size

    def _rebuild_index(self) -> None:
        files = sorted(self.dir.glob("*" + _SUFFIX), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                key = bytes.fromhex(path.name.removesuffix(_SUFFIX))
                with path.open("rb") as f:
                    header = self._read_header(f)
            except (OSError, ValueError):
                header, key = None, b""
            if header is None:
                self.all_stats.corrupt += 1
                logger.warning("KV disk tier: %s is not a valid block file; skipped", path.name)
                continue
            fingerprint, _, size = header
            if fingerprint != self.fingerprint:
                self.all_stats.foreign += 1
                continue
            self.index[key] = size
            self.stats.bytes += size
        self.stats.blocks = len(self.index)
        if self.index:
            logger.info(
                "KV disk tier: %d blocks (%.1f MiB) found in %s",
                len(self.index), self.stats.bytes / 2**20, self.dir,
            )  # fmt: skip
        self._trim()

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                self._queue.task_done()
                return
            with self._lock:
                payload = self.pending.get(key)
            if payload is not None:
                path = self._path(key)
                tmp = path.with_suffix(".tmp")
                try:
                    with tmp.open("wb") as f:
                        f.write(self._header(payload))
                        f.write(payload)
                    os.replace(tmp, path)
                except OSError as exc:
                    logger.warning("KV disk tier: cannot write %s: %s", path.name, exc)
                    with self._lock:
                        if self.index.pop(key, None) is not None:
                            self.stats.bytes -= len(payload)
                            self.stats.blocks = len(self.index)
                with self._lock:
                    self.pending.pop(key, None)
                    gone = key not in self.index  # taken or trimmed while being written
                if gone:
                    path.unlink(missing_ok=True)
            self._queue.task_done()

    # ----------------------------------------------------------------- blocks

    def put(self, key: bytes, payload: bytes) -> None:
        with self._lock:
            if key in self.index:
                self.index.move_to_end(key)
                return
            self.index[key] = len(payload)
            self.pending[key] = payload
            self.stats.bytes += len(payload)
            self.stats.blocks = len(self.index)
        self._queue.put(key)
        self._trim()

    def _trim(self) -> None:
        while True:
            with self._lock:
                if not self.index or self.stats.bytes <= self.capacity:
                    return
                key, size = self.index.popitem(last=False)
                self.stats.bytes -= size
                self.stats.blocks = len(self.index)
                self.stats.evictions += 1
                self.pending.pop(key, None)
            self._path(key).unlink(missing_ok=True)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self.index

    def discard(self, key: bytes) -> None:
        """Forget a block (its file is deleted), if this tier holds it."""
        with self._lock:
            size = self.index.pop(key, None)
            if size is None:
                return
            self.stats.bytes -= size
            self.stats.blocks = len(self.index)
            self.pending.pop(key, None)
        self._path(key).unlink(missing_ok=True)

    def take(self, key: bytes) -> bytes | None:
        """The block's payload, removed from this tier; None (a miss) when absent or corrupt."""
        with self._lock:
            size = self.index.pop(key, None)
            if size is None:
                return None
            self.stats.bytes -= size
            self.stats.blocks = len(self.index)
            payload = self.pending.pop(key, None)
        if payload is not None:
            return payload
        path = self._path(key)
        try:
            with path.open("rb") as f:
                header = self._read_header(f)
                data = f.read() if header is not None else b""
        except OSError:
            header, data = None, b""
        path.unlink(missing_ok=True)
        if header is None or header[0] != self.fingerprint:
            with self._lock:
                self.all_stats.corrupt += 1
            logger.warning("KV disk tier: block file %s is damaged; recomputed", path.name)
            return None
        _, digest, size = header
        if len(data) != size or hashlib.sha256(data).digest() != digest:
            with self._lock:
                self.all_stats.corrupt += 1
            logger.warning("KV disk tier: block file %s fails its checksum; recomputed", path.name)
            return None
        return data

    def take_async(self, key: bytes) -> Future[bytes | None]:
        """`take` on a reader thread (file reads and SHA-256 release the GIL)."""
        return self._readers.submit(self.take, key)

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)


class KvTiers:
    """The host tier and, optionally, the disk tier behind it."""

    def __init__(
        self,
        host_bytes: int,
        disk_dir: str | Path | None = None,
        disk_bytes: int = 0,
        fingerprint: bytes = b"",
    ) -> None:
        self.stats = TiersStats()
        self.host = HostTier(host_bytes, self.stats.host)
        self.disk = (
            DiskTier(Path(disk_dir), disk_bytes, fingerprint, self.stats)
            if disk_dir is not None
            else None
        )

    def put(self, key: bytes, payload: Payload) -> None:
        """Keep an evicted block (host first; what the host pushes out goes to disk). A block
        evicted again while its older copy sits on disk replaces that copy."""
        if self.disk is not None:
            self.disk.discard(key)
        for old, data in self.host.put(key, payload):
            if self.disk is not None:
                self.disk.put(old, payload_bytes(data))

    def contains(self, key: bytes) -> bool:
        return key in self.host.items or (self.disk is not None and self.disk.contains(key))

    def match(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, some tier holds."""
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def take(self, key: bytes) -> tuple[Payload, str] | None:
        """(payload, tier name) of a block, removed from its tier (the caller writes it back
        into a device block, which the prefix cache holds from then on); None on a miss."""
        payload = self.host.take(key)
        if payload is not None:
            self.stats.host.hits += 1
            return payload, "host"
        self.stats.host.misses += 1
        if self.disk is None:
            return None
        payload = self.disk.take(key)
        if payload is None:
            self.stats.disk.misses += 1
            return None
        self.stats.disk.hits += 1
        return payload, "disk"

    def take_many(self, keys: Sequence[bytes]) -> list[tuple[Payload, str]]:
        """`take` of `keys` in order, up to the first miss; the disk tier's files are read
        and checksummed on `_DISK_READERS` threads at once. A block read after the first miss
        (its chain is broken: the caller recomputes from there) goes back to the host tier."""
        found: list[tuple[Payload, str] | Future[bytes | None]] = []
        for key in keys:
            payload = self.host.take(key)
            if payload is not None:
                self.stats.host.hits += 1
                found.append((payload, "host"))
                continue
            self.stats.host.misses += 1
            if self.disk is None or not self.disk.contains(key):
                if self.disk is not None:
                    self.stats.disk.misses += 1
                break
            found.append(self.disk.take_async(key))
        out: list[tuple[Payload, str]] = []
        broken = False
        for key, item in zip(keys, found, strict=False):
            if isinstance(item, Future):
                data = item.result()
                if data is None:
                    self.stats.disk.misses += 1
                    broken = True
                    continue
                self.stats.disk.hits += 1
                item = (data, "disk")
            if broken:
                self.put(key, item[0])
            else:
                out.append(item)
        return out

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
