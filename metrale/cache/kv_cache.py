"""Paged KV tensors: per attention layer one K and one V tensor of
`[num_blocks, block_size, kv_heads, head_dim]`, in the model dtype or in float8 E4M3 with a
K scale and a V scale per layer (`--kv-cache-dtype fp8`).

Owner: cache. The model engine writes and reads them through the kernels; the block pool
decides which blocks a sequence owns.

Invariants:
- Shapes and dtype are fixed at construction; nothing reallocates them while serving.
- `layers[i]` is a `KvLayer`: the `(k_cache, v_cache)` pair (it unpacks as a 2-tuple) with
  that layer's scales, `[1]` float32 device tensors (1.0 unless set), views of one `scales`
  tensor `[num_layers, 2]`. A float8 pool stores `clamp(x / scale, -448, 448)` cast to E4M3
  and every reader multiplies by the scale (`metrale.kernels.reference.quantize_kv`); a pool
  in the model dtype ignores them. Scales change only in place (`set_scales`, calibration),
  so captured CUDA graphs read the current values.
- Calibration (float8 pools without checkpoint scales): `arm_calibration` marks every layer
  pending; a pending layer's next KV write first sets its scales to `amax(|k|) / 448` and
  `amax(|v|) / 448` of the rows being written (1.0 for an all-zero tensor) and clears the
  mark, so each layer calibrates once, on the first forward after arming (the first prefill
  chunk; the loader arms after its warm-up forwards), and its scales are then fixed.
- Every copy of blocks (copy-on-write, swap, tiers, high-speed swap) moves bytes, whatever
  the dtype: a float8 block round-trips bit for bit under the same scales.
- Block 0 (the null block) exists in every layer and may hold garbage: nothing reads it
  except padded rows, whose outputs are discarded.
- A batched restore (`write_blocks_bytes`) uses helper threads only to fill its host buffer;
  every device copy is issued by the calling thread, on its current stream.
- `block_payload` issues its device-to-host copy on the current stream, so a later kernel
  that overwrites the block (stream order) cannot race it; the payload's event says when the
  host side may read it. A `HostBlock` payload restores by one host-to-device DMA from its
  own (pinned) tensor, with no host memcpy.
- On CUDA those tensors are rows of pinned slabs (`PinnedRows`), so the host tier's bytes
  are the pinned bytes, within one row a slab (the caching host allocator rounds each
  allocation up to a power of two: a slab is sized to one). A row returns to its slab when its payload is collected; every copy into or out of
  a row is issued on the pool's one stream, so a reused row's new copy runs after the old.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from metrale.cache.kv_tiers import HostBlock, Payload

#: Most bytes `write_blocks_bytes` stages on the device at once.
_STAGING_BYTES = 128 << 20
#: Threads gathering a restore's payloads into its host buffer.
_COPY_THREADS = 4
#: KV dtypes stored as scaled float8 (a scale per layer for K and for V).
FP8_KV_DTYPES = (torch.float8_e4m3fn,)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as bytes where torch lacks an indexing kernel for its dtype (float8 on the
    CPU has no `index_copy_`); the same tensor otherwise."""
    return t.view(torch.uint8) if t.dtype in FP8_KV_DTYPES else t


class KvLayer(tuple):
    """One attention layer's `(k_cache, v_cache)` (unpacks as that pair) with its float8
    scales `k_scale`, `v_scale` (`[1]` float32 on the cache's device) and its calibration
    mark. `scaled` says whether the caches are float8 (the scales apply)."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor
    calibration_pending: bool

    def __new__(
        cls, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor
    ) -> KvLayer:
        self = super().__new__(cls, (k, v))
        self.k_scale = k_scale
        self.v_scale = v_scale
        self.calibration_pending = False
        return self

    @property
    def scaled(self) -> bool:
        return self[0].dtype in FP8_KV_DTYPES

    def scale_kwargs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments the KV ops take for this layer: the scales of a float8
        cache, nothing for a cache in the model dtype."""
        return {"k_scale": self.k_scale, "v_scale": self.v_scale} if self.scaled else {}

    def calibrate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set the scales from the rows about to be written (see the module invariants) and
        clear the mark; a no-op unless pending."""
        if not self.calibration_pending:
            return
        fmax = torch.finfo(self[0].dtype).max
        for rows, scale in ((k, self.k_scale), (v, self.v_scale)):
            amax = rows.detach().abs().amax().float().reshape(1) if rows.numel() else None
            if amax is None:
                scale.fill_(1.0)
                continue
            scale.copy_(torch.where(amax > 0, amax / fmax, torch.ones_like(amax)))
        self.calibration_pending = False


#: Bytes of one pinned slab of `PinnedRows` (a power of two: the caching host allocator
#: rounds every allocation up to one).
_SLAB_BYTES = 256 << 20


class PinnedRows:
    """Pinned host rows of `row_bytes`, carved from slabs of as many rows as fit in a
    power-of-two allocation (allocated as needed, never returned); a row goes back to the
    free list when the `HostBlock` holding it is collected."""

    def __init__(self, row_bytes: int) -> None:
        self.row_bytes = row_bytes
        slab = max(_SLAB_BYTES, 1 << (row_bytes - 1).bit_length())
        self.rows_per_slab = slab // row_bytes
        self.slabs: list[torch.Tensor] = []
        self.free: list[tuple[int, int]] = []

    def payload(self) -> HostBlock:
        if not self.free:
            slab = torch.empty((self.rows_per_slab, self.row_bytes), dtype=torch.uint8,
                               pin_memory=True)  # fmt: skip
            self.slabs.append(slab)
            n = len(self.slabs) - 1
            self.free.extend((n, r) for r in range(self.rows_per_slab - 1, -1, -1))
        slab_id, row = self.free.pop()
        block = HostBlock(self.slabs[slab_id][row], slab=self.slabs[slab_id], row=row)
        weakref.finalize(block, self.free.append, (slab_id, row))
        return block

    @property
    def pinned_bytes(self) -> int:
        return len(self.slabs) * self.rows_per_slab * self.row_bytes


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        #: Per layer (K scale, V scale), float32; used only by a float8 pool.
        self.scales = torch.ones((num_layers, 2), dtype=torch.float32, device=device)
        self._scales_source = "unset" if self.quantized else "none"
        self.layers: list[KvLayer] = [
            KvLayer(
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
                self.scales[i, 0:1],
                self.scales[i, 1:2],
            )
            for i in range(num_layers)
        ]
        #: Threads of `write_blocks_bytes` (started on the first batched restore).
        self._copy_pool: ThreadPoolExecutor | None = None
        #: Pinned rows of `block_payload` on CUDA (made on the first offload).
        self._pinned: PinnedRows | None = None

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored as scaled float8."""
        return self.dtype in FP8_KV_DTYPES

    def set_scales(self, scales: torch.Tensor, source: str = "checkpoint") -> None:
        """Per-layer `[num_layers, 2]` (K, V) scales, copied in place; each must be > 0."""
        if tuple(scales.shape) != tuple(self.scales.shape):
            raise ValueError(
                f"KV scales of shape {tuple(scales.shape)}; this pool needs "
                f"{tuple(self.scales.shape)} (a K and a V scale per layer)"
            )
        if not bool((scales > 0).all()) or not bool(torch.isfinite(scales).all()):
            raise ValueError("KV scales must be finite and > 0")
        self.scales.copy_(scales)
        self._scales_source = source
        for layer in self.layers:
            layer.calibration_pending = False

    def arm_calibration(self) -> None:
        """Calibrate every layer's scales on its next KV write (module invariants)."""
        if not self.quantized:
            raise ValueError("only a float8 KV pool has scales to calibrate")
        self._scales_source = "calibrating"
        for layer in self.layers:
            layer.calibration_pending = True

    @property
    def calibration_pending(self) -> bool:
        """Whether some layer still waits for its first write to set its scales."""
        return any(layer.calibration_pending for layer in self.layers)

    @property
    def scales_source(self) -> str:
        """Where the scales came from: "none" (model dtype: unused), "unset" (1.0),
        "checkpoint", "calibrating" (armed; some layer has not written yet), "calibrated"."""
        if self._scales_source == "calibrating" and not self.calibration_pending:
            return "calibrated"
        return self._scales_source

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def block_bytes(self, block: int) -> bytes:
        """One block's K and V of every layer, as raw bytes (a lower tier's payload)."""
        parts = [t[block].reshape(-1).view(torch.uint8) for kv in self.layers for t in kv]
        return torch.cat(parts).cpu().numpy().tobytes()

    def block_payload(self, block: int) -> HostBlock:
        """`block_bytes` as a `HostBlock`: the parts joined on the device, then one
        asynchronous copy into a pinned row (CUDA, with the event after it); on the CPU a
        plain copy."""
        parts = [t[block].reshape(-1).view(torch.uint8) for kv in self.layers for t in kv]
        flat = torch.cat(parts)
        if flat.device.type != "cuda":
            return HostBlock(flat)
        if self._pinned is None:
            self._pinned = PinnedRows(flat.numel())
        payload = self._pinned.payload()
        payload.data.copy_(flat, non_blocking=True)
        payload.ready = torch.cuda.Event()
        payload.ready.record()
        return payload

    def write_blocks_bytes(self, blocks: Sequence[int], payloads: Sequence[Payload]) -> None:
        """`write_block_bytes` for many blocks at once, in chunks of at most `_STAGING_BYTES`:
        `bytes` payloads are gathered into one host buffer (pinned on CUDA; one memcpy each)
        and copied to the device in one transfer; `HostBlock` payloads are copied straight
        from their tensors (a DMA each from pinned memory, no host memcpy). Each chunk is then
        scattered with one `index_copy_` per layer tensor, so a restored prefix costs a few
        kernels per chunk instead of one copy per layer tensor and block."""
        if len(blocks) != len(payloads):
            raise ValueError(f"{len(blocks)} blocks for {len(payloads)} payloads")
        device = self.layers[0][0].device
        size = self.bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )
        for payload in payloads:
            if len(payload) != size:
                raise ValueError(
                    f"a KV block payload of {len(payload)} bytes; this pool's are {size}"
                )
        per_chunk = max(1, _STAGING_BYTES // size)
        for first in range(0, len(blocks), per_chunk):
            chunk = payloads[first : first + per_chunk]
            staging, order = self._stage(chunk, size, device)
            targets = [blocks[first + i] for i in order]
            idx = torch.tensor(targets, dtype=torch.long).to(device, non_blocking=True)
            offset = 0
            for kv in self.layers:
                for t in kv:
                    n = t[0].numel() * t.element_size()
                    raw = _raw(t)
                    src = (
                        staging[:, offset : offset + n]
                        .view(raw.dtype)
                        .view(len(chunk), *raw.shape[1:])
                    )
                    raw.index_copy_(0, idx, src)
                    offset += n

    def _stage(
        self, chunk: Sequence[Payload], size: int, device: torch.device
    ) -> tuple[torch.Tensor, list[int]]:
        """`[len(chunk), size]` uint8 rows of the payloads on `device`, and the order they are
        in (row j holds `chunk[order[j]]`). Bytes come first: plain memcpys into one (pinned,
        on CUDA) buffer and one asynchronous copy, so the next chunk's memcpys overlap it
        (the caching host allocator keeps a pinned buffer until the copies using it are
        done). Host blocks follow, sorted by slab and row, so each run of adjacent pinned
        rows is one DMA."""
        cuda = device.type == "cuda"

        def key(i: int) -> tuple[int, int, int]:
            p = chunk[i]
            if isinstance(p, bytes):
                return (0, 0, i)
            return (1, p.slab.data_ptr(), p.row) if p.slab is not None else (2, 0, i)

        order = sorted(range(len(chunk)), key=key)
        raw = [i for i in order if isinstance(chunk[i], bytes)]
        if len(raw) == len(chunk):
            host = torch.empty((len(chunk), size), dtype=torch.uint8, pin_memory=cuda)
            self._fill_rows(host.numpy(), chunk)  # type: ignore[arg-type]
            return (host.to(device, non_blocking=True) if cuda else host), order
        staging = torch.empty((len(chunk), size), dtype=torch.uint8, device=device)
        if raw:
            host = torch.empty((len(raw), size), dtype=torch.uint8, pin_memory=cuda)
            self._fill_rows(host.numpy(), [chunk[i] for i in raw])  # type: ignore[misc]
            staging[: len(raw)].copy_(host, non_blocking=True)
        j = len(raw)
        while j < len(order):
            p = chunk[order[j]]
            assert isinstance(p, HostBlock)
            n = 1
            while p.slab is not None and j + n < len(order):
                q = chunk[order[j + n]]
                if not (isinstance(q, HostBlock) and q.slab is p.slab and q.row == p.row + n):
                    break
                n += 1
            src = p.data if n == 1 else p.slab[p.row : p.row + n]  # type: ignore[index]
            staging[j : j + n].copy_(src, non_blocking=True)
            j += n
        return staging, order

    def _fill_rows(self, rows: np.ndarray, payloads: Sequence[bytes]) -> None:
        """`rows[i] = payloads[i]`, on `_COPY_THREADS` threads (numpy releases the GIL for a
        large copy, so several cores share a restore's memcpys)."""

        def fill(i: int) -> None:
            rows[i] = np.frombuffer(payloads[i], dtype=np.uint8)

        threads = min(_COPY_THREADS, os.cpu_count() or 1, len(payloads))
        if threads <= 1:
            for i in range(len(payloads)):
                fill(i)
            return
        if self._copy_pool is None:
            self._copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="kv-restore")
        list(self._copy_pool.map(fill, range(len(payloads))))

    def write_block_bytes(self, block: int, payload: bytes) -> None:
        """Inverse of `block_bytes`: the payload's K and V into `block` of every layer."""
        device = self.layers[0][0].device
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        offset = 0
        for kv in self.layers:
            for t in kv:
                n = t[block].numel() * t.element_size()
                t[block].copy_(raw[offset : offset + n].view(t.dtype).view(t[block].shape))
                offset += n
        if offset != len(payload):
            raise ValueError(
                f"a KV block payload of {len(payload)} bytes; this pool's are {offset}"
            )

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V in every layer (copy-on-write of a shared block)."""
        for k, v in self.layers:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """`copy_block(src[i], dst[i])` for every i in one gather + scatter per tensor (no
        `dst` may be a `src`); the block ids go to the device without a sync."""
        if len(src) != len(dst):
            raise ValueError("copy_blocks needs as many destinations as sources")
        if not src:
            return
        if set(src) & set(dst):
            raise ValueError("copy_blocks: a destination block is also a source")
        device = self.layers[0][0].device
        ids = torch.tensor([*src, *dst], dtype=torch.long).to(device, non_blocking=True)
        s, d = ids[: len(src)], ids[len(src) :]
        for kv in self.layers:
            for t in map(_raw, kv):
                t.index_copy_(0, d, t.index_select(0, s))

    def read_blocks(self, blocks: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the given blocks of every layer, on the host (for swap-out); a float8
        pool's as their bytes (uint8: pickle cannot load float8 tensors back)."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.layers[0][0].device)
        return [
            (_raw(k).index_select(0, idx).cpu(), _raw(v).index_select(0, idx).cpu())
            for k, v in self.layers
        ]

    def write_blocks(
        self, blocks: list[int], data: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Inverse of `read_blocks` (for swap-in); float8 blocks arrive as their bytes."""
        idx = torch.tensor(blocks, dtype=torch.long, device=self.layers[0][0].device)
        for (k, v), (hk, hv) in zip(self.layers, data, strict=True):
            _raw(k).index_copy_(0, idx, _raw(hk).to(k.device))
            _raw(v).index_copy_(0, idx, _raw(hv).to(v.device))
