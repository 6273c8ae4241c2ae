"""Vision input on the engine side: a sequence's images (`VisionInputs`), their M-RoPE
positions and prefix-cache keys, and `VisionForwards`, the `TransformerModel` mixin that runs
the vision encoder before the prefill chunk that needs it and merges its rows into the
forward.

Owner: model-engine. `VisionInputs` is plain data (numpy, picklable: it crosses the engine
process boundary and rides on the scheduler's sequence, which never looks inside). The engine
builds it (`metrale.engine.vision`) when a request carries images.

Invariants:
- Item `i` covers prompt positions `[offset, offset + num_tokens)`, all holding the image
  (or video) pad token; items do not overlap and are in prompt order.
- Every image is encoded at most once while its rows sit in the encoder cache (keyed by the
  image's content hash, bounded by `encoder_cache_tokens` rows, least recently used out);
  a forward encodes every missing image of its rows in one tower pass, before the decoder
  runs, so a prefill chunk may start or end inside an image.
- Prefix-cache keys (`key_tokens`) replace an image's pad tokens by a value derived from its
  hash (never a real token id, never `FED_TOKEN`): two prompts share KV through an image only
  when the image content is the same. `lookup_prefix` / `cache_sequence` key through the
  sequence's own `vision`; the scheduler keys the admission estimate the same way.
- Positions past the prompt (generated tokens, a recompute after preemption) are
  `index + delta` on all three streams, as transformers continues them; a preempted vision
  sequence therefore recomputes exactly (its `VisionInputs` stays with the request).
- Graphed decode steps (CUDA) pass `seq_len + delta` as the rotary positions while slots
  and lengths follow `seq_len` (every M-RoPE stream equal is plain rotary); graphed verify
  steps take no such offset, so a verify with a shifted row runs eagerly (counted in
  `vision_stats["eager_verify_forwards"]`).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from metrale.model_engine.traits import SequenceState

if TYPE_CHECKING:
    from metrale.model_engine.batch import ForwardRow

logger = logging.getLogger(__name__)

#: Prefix-cache key values of image pad positions start here (above any vocabulary).
KEY_BASE = 1 << 40


@dataclass
class VisionItem:
    """One image (or video) of a prompt, preprocessed."""

    digest: str
    kind: str
    #: float32 `[patches, C * T * p * p]`.
    pixel_values: np.ndarray
    grid: tuple[int, int, int]
    offset: int
    num_tokens: int

    @property
    def key(self) -> int:
        return KEY_BASE + int(self.digest[:10], 16)


@dataclass
class VisionInputs:
    """A prompt's images and its M-RoPE positions."""

    items: list[VisionItem]
    #: int64 `[3, prompt_len]`: temporal, height, width positions of every prompt token.
    positions: np.ndarray
    #: Position of token `i >= prompt_len` is `i + delta` (all streams).
    delta: int
    pad_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def prompt_len(self) -> int:
        return int(self.positions.shape[1])

    def key_tokens(self, tokens: Sequence[int]) -> list[int]:
        """`tokens` with every image's pad positions replaced by the image's key."""
        out = list(tokens)
        for item in self.items:
            end = min(item.offset + item.num_tokens, len(out))
            if item.offset < end:
                out[item.offset : end] = [item.key] * (end - item.offset)
        return out

    def positions_for(self, start: int, count: int) -> np.ndarray:
        """int64 `[3, count]` positions of tokens `start .. start + count - 1`."""
        end = start + count
        n = self.prompt_len
        if end <= n:
            return self.positions[:, start:end]
        tail = np.arange(max(start, n), end, dtype=np.int64) + self.delta
        tail3 = np.broadcast_to(tail, (3, tail.shape[0]))
        if start >= n:
            return np.ascontiguousarray(tail3)
        return np.concatenate([self.positions[:, start:n], tail3], axis=1)


def content_digest(pixel_values: np.ndarray, grid: tuple[int, int, int]) -> str:
    """The encoder cache's key of one preprocessed image: a hash of its patches and grid."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(grid)).encode())
    h.update(np.ascontiguousarray(pixel_values, dtype=np.float32).tobytes())
    return h.hexdigest()


def mrope_positions(
    num_tokens: int,
    items: Sequence[VisionItem],
    merge: int,
    time_intervals: Sequence[float] | None = None,
) -> tuple[np.ndarray, int]:
    """`(positions [3, num_tokens], delta)`: text tokens advance all three streams by one;
    an image's tokens take (frame, row, column) offsets from the position after the text
    before it, and the text after it continues past its largest side (transformers'
    `get_rope_index`). `time_intervals[i]`: the temporal step of item `i` (1 for images)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor, current = 0, 0
    for i, item in enumerate(items):
        text = item.offset - cursor
        out[:, cursor : item.offset] = np.arange(current, current + text)
        current += text
        t, h, w = item.grid
        gh, gw = h // merge, w // merge
        step = time_intervals[i] if time_intervals is not None else 1.0
        tpos = (np.arange(t) * step).astype(np.int64) + current
        grid = np.stack(
            np.meshgrid(tpos, np.arange(gh) + current, np.arange(gw) + current, indexing="ij")
        ).reshape(3, -1)
        if grid.shape[1] != item.num_tokens:
            raise ValueError(
                f"image grid {item.grid} makes {grid.shape[1]} tokens, not {item.num_tokens}"
            )
        out[:, item.offset : item.offset + item.num_tokens] = grid
        current += max(gh, gw)
        cursor = item.offset + item.num_tokens
    out[:, cursor:] = np.arange(current, current + num_tokens - cursor)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta


class VisionForwards:
    """Encoder cache and the vision part of each forward (a mixin of `TransformerModel`)."""

    module: torch.nn.Module
    device: torch.device

    def _vision_setup(self, cache_tokens: int = 16384) -> None:
        self.vision_enabled = hasattr(self.module, "encode_images")
        self.encoder_cache_tokens = cache_tokens
        self._encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._encoder_cached_rows = 0
        self.vision_stats = {
            "encoder_passes": 0,
            "images_encoded": 0,
            "encoder_cache_hits": 0,
            "graphed_shifted_decodes": 0,
            "eager_verify_forwards": 0,
        }

    # ------------------------------------------------------------ the seed's interface

    def prepare_vision_embed(self, items: Sequence[Any]) -> None:
        self.prepare_vision_embed_batched([items])

    def prepare_vision_embed_batched(
        self, items: Sequence[Sequence[Any]]
    ) -> list[tuple[int, int, int, int]]:
        """Encode every image of `items` not already cached, in one tower pass. Returns, per
        request, `(first row, first grid, images, rows)` in that pass's order (cached images
        included, so offsets describe the request's rows as if all were encoded)."""
        flat = [it for group in items for it in group]
        self._encode_missing(flat)
        spans, row, grid = [], 0, 0
        for group in items:
            rows = sum(it.num_tokens for it in group)
            spans.append((row, grid, len(group), rows))
            row += rows
            grid += len(group)
        return spans

    def set_vision_slice_base(self, row_base: int, grid_base: int, owned_images: int) -> None:
        """A no-op: each forward finds its rows by image hash (`_vision_batch`), so there is
        no shared output whose slice a chunk must be pointed at."""
        return None

    def tokens_contain_vision_pad(self, tokens: Sequence[int]) -> bool:
        cfg = getattr(self.module, "vision_config", None)
        if cfg is None:
            return False
        pads = {cfg.image_token_id, cfg.video_token_id}
        return any(t in pads for t in tokens)

    # ------------------------------------------------------------------- the cache

    def _encode_missing(self, items: Sequence[VisionItem]) -> dict[str, torch.Tensor]:
        """The encoder rows of every item (a local map, safe from eviction meanwhile)."""
        found: dict[str, torch.Tensor] = {}
        missing: list[VisionItem] = []
        for it in items:
            if it.digest in found or any(m.digest == it.digest for m in missing):
                continue
            rows = self._encoder_cache.get(it.digest)
            if rows is not None:
                self._encoder_cache.move_to_end(it.digest)
                self.vision_stats["encoder_cache_hits"] += 1
                found[it.digest] = rows
            else:
                missing.append(it)
        if missing:
            module: Any = self.module
            pixels = torch.from_numpy(np.concatenate([m.pixel_values for m in missing])).to(
                self.device
            )
            with torch.inference_mode():
                encoded = module.encode_images(pixels, [m.grid for m in missing])
            self.vision_stats["encoder_passes"] += 1
            self.vision_stats["images_encoded"] += len(missing)
            for m, rows in zip(missing, encoded, strict=True):
                if rows.shape[0] != m.num_tokens:
                    raise ValueError(
                        f"image {m.digest[:12]} encodes to {rows.shape[0]} rows, its prompt holds "
                        f"{m.num_tokens} pad tokens"
                    )
                found[m.digest] = rows
                self._encoder_cache[m.digest] = rows
                self._encoder_cached_rows += rows.shape[0]
            while self._encoder_cached_rows > self.encoder_cache_tokens and self._encoder_cache:
                _, old = self._encoder_cache.popitem(last=False)
                self._encoder_cached_rows -= old.shape[0]
        return found

    # ------------------------------------------------------------------- a forward

    def _vision_rows_present(self, rows: Sequence[ForwardRow]) -> bool:
        return self.vision_enabled and any(r.seq.vision is not None for r in rows)

    def _vision_batch(
        self, rows: Sequence[ForwardRow], positions: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """`(positions for the module, extra keyword arguments)`: `[3, T]` M-RoPE positions and
        the encoder rows replacing pad-token embeddings when a row carries images; the
        metadata's `[T]` positions and nothing otherwise."""
        if not self._vision_rows_present(rows):
            return positions, {}
        pos_parts: list[np.ndarray] = []
        needed: list[tuple[int, VisionItem, int, int]] = []  # (batch row, item, first, count)
        base = 0
        for r in rows:
            n, start = len(r.tokens), r.start
            vision: VisionInputs | None = r.seq.vision
            if vision is None:
                idx = np.arange(start, start + n, dtype=np.int64)
                pos_parts.append(np.broadcast_to(idx, (3, n)))
            else:
                pos_parts.append(vision.positions_for(start, n))
                for it in vision.items:
                    lo, hi = max(start, it.offset), min(start + n, it.offset + it.num_tokens)
                    if lo < hi:
                        needed.append((base + lo - start, it, lo - it.offset, hi - lo))
            base += n
        pos = torch.from_numpy(np.concatenate(pos_parts, axis=1)).to(self.device)
        if not needed:
            return pos, {}
        encoded = self._encode_missing([it for _, it, _, _ in needed])
        index = torch.cat([torch.arange(b, b + c, dtype=torch.int64) for b, _, _, c in needed]).to(
            self.device
        )
        merged = torch.cat([encoded[it.digest][f : f + c] for _, it, f, c in needed])
        return pos, {"vision_rows": (index, merged)}

    def _vision_shifted_positions(
        self, seqs: Sequence[SequenceState], positions: np.ndarray
    ) -> np.ndarray | None:
        """A graphed decode step's rotary positions (`position + delta` per row) when some
        row continues after an image with a non-zero M-RoPE delta; None otherwise. With every
        stream at one position, M-RoPE is the plain rotary the decode graphs apply."""
        if not self.vision_enabled:
            return None
        deltas = [s.vision.delta if s.vision is not None else 0 for s in seqs]
        if not any(deltas):
            return None
        self.vision_stats["graphed_shifted_decodes"] += 1
        return positions + np.asarray(deltas, dtype=np.int64)

    def _vision_verify_eager(self, seqs: Sequence[SequenceState]) -> bool:
        """Whether a verify step must run eagerly: the verify graphs take no rotary
        positions apart from the cache's, so rows after an image (a delta) run eagerly
        (counted)."""
        if not self.vision_enabled:
            return False
        shifted = any(s.vision is not None and s.vision.delta != 0 for s in seqs)
        if shifted:
            self.vision_stats["eager_verify_forwards"] += 1
        return shifted

    # ---------------------------------------------------- prefix-cache keys (over the
    # `PagedKvLifecycle` methods, which come after this mixin in `TransformerModel`'s MRO)

    def lookup_prefix(self, seq: SequenceState, tokens: Sequence[int]) -> int:
        vision: VisionInputs | None = seq.vision
        if vision is None:
            return super().lookup_prefix(seq, tokens)  # type: ignore[misc]
        reused = int(super().lookup_prefix(seq, vision.key_tokens(tokens)))  # type: ignore[misc]
        if seq.tokens:
            seq.tokens = list(tokens[: len(seq.tokens)])  # the real ids, not the keys
        return reused

    def cache_sequence(self, seq: SequenceState) -> None:
        vision: VisionInputs | None = seq.vision
        if vision is None:
            super().cache_sequence(seq)  # type: ignore[misc]
            return
        real = seq.tokens
        seq.tokens = vision.key_tokens(real)
        try:
            super().cache_sequence(seq)  # type: ignore[misc]
        finally:
            seq.tokens = real
