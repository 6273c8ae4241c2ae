"""`TransformerModel`: the `Model` implementation that binds an architecture module to the paged
KV cache, the block pool, batch metadata and the logits of each forward.

Owner: model-engine. The scheduler drives it only through the `Model` interface.

Invariants:
- Every forward (decode rows, prefill chunks or both) is one call of the architecture module.
  Blocks for all rows are allocated before it runs, all or nothing: on `KVCacheExhausted` no
  sequence has changed.
- After a forward each row's sequence has `tokens` extended by the row's tokens, `seq_len`
  advanced by the same count and `kv_valid_tokens == seq_len`.
- `free_sequence` drops exactly the references the sequence holds (its blocks, its prefix
  refs, its slots) and leaves it empty, so a second call releases nothing.
- Logits rows are float32 `[rows, vocab_size]`.
- A fed decode step (`decode_batch_fed`, the device token feed) advances its sequences like
  any forward but records `FED_TOKEN` in `tokens` at the new position; the scheduler's commit
  of the previous step overwrites it, and `cache_sequence` never indexes a position holding it.
- A verify row (`mixed_verify_batch`: a decode row with drafts) advances by its last token
  plus its drafts and returns logits for each; `commit_accepted_prefix` then drops the
  rejected drafts from `seq_len`, `tokens` and `kv_valid_tokens` and returns the blocks past
  the kept tokens, which only that verify had allocated. Refused on hybrid models.
- Hybrid models (an SSM slot pool is given): every live sequence holds one pool slot from
  `alloc_sequence` until `free_sequence` (its guard also returns it if the state is dropped),
  `slot_idx` names it, and a forward refuses a row whose slot state does not cover exactly the
  tokens before the row (so a KV prefix without its recurrent state is never used silently).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np
import torch

from metrale.cache.block_pool import BlockPool
from metrale.cache.kv_cache import PagedKVCache
from metrale.cache.radix import RadixPrefixCache
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.errors import InvalidRequestError, KVCacheExhausted, Unsupported
from metrale.kernels import KernelOps
from metrale.model_engine.batch import ForwardRow, build_forward_batch
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from metrale.model_engine.traits import (
    DETACHED_SLOT,
    FED_TOKEN,
    FeedSource,
    MixedBatchResult,
    Model,
    PrefillSlice,
    PrefixReclaim,
    PromptTokenLogprob,
    SequenceState,
    Stream,
    VerifyBatchedOpts,
    blocks_for,
    blocks_needed,
)
from metrale.models.config import ModelConfig

logger = logging.getLogger(__name__)


class TransformerModel(Model):
    def __init__(
        self,
        module: torch.nn.Module,
        config: ModelConfig,
        kv_cache: PagedKVCache,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        ssm_pool: SsmSlotPool | None = None,
    ) -> None:
        self.module = module
        self.ssm_pool = ssm_pool
        self.config = config
        self.kv_cache = kv_cache
        self.block_pool = BlockPool(kv_cache.num_blocks)
        self.block_size = kv_cache.block_size
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self._next_slot = 0
        #: Decode CUDA graphs (set by the factory on CUDA); None runs every forward eagerly.
        self.graph_runner: DecodeGraphRunner | None = None
        #: Forwards run eagerly (prefills, mixed steps, and decode when no graph applies).
        self.eager_forwards = 0
        #: op name -> "torch" | "triton" | "triton+pdl", as the factory selected them.
        self.kernel_implementations: dict[str, str] = {}
        #: The op set the factory built the layers with (the engine's sampler uses its
        #: `argmax` / `top_k_top_p_sample`); None when built outside the factory.
        self.kernel_ops: KernelOps | None = None
        self._last_hidden: torch.Tensor | None = None
        self.prefix_cache: RadixPrefixCache | None = None
        #: Lookups refused because a KV hit cannot be used on this model (hybrid SSM state).
        self.prefix_cache_bypasses = 0
        self._prefix_bypassed = enable_prefix_caching and self.has_ssm_layers()
        if self._prefix_bypassed:
            logger.warning(
                "prefix caching is bypassed: this model keeps recurrent (SSM) state that a KV "
                "prefix hit cannot restore; every prompt is computed in full"
            )
        elif enable_prefix_caching:
            self.prefix_cache = RadixPrefixCache(self.block_pool, self.block_size)

    # ---------------------------------------------------------------- lifecycle

    def alloc_sequence(self) -> SequenceState:
        if self.ssm_pool is not None:
            guard = self.ssm_pool.allocate()  # KVCacheExhausted when every slot is live
            idx = guard.idx()
            assert idx is not None
            seq = SequenceState(slot_idx=idx, ssm_slot=guard)
        else:
            seq = SequenceState(slot_idx=self._next_slot)
            self._next_slot += 1
        seq.disk_last_offloaded_per_layer = [0] * self.module.kv_layer_count
        return seq

    # ------------------------------------------------------------------ facts

    def max_context_len(self) -> int:
        return self.max_model_len

    def fits_context(self, seq: SequenceState, new_tokens: int) -> bool:
        """Whether `seq` stays within `max_model_len` after `new_tokens` more tokens."""
        return seq.seq_len + new_tokens <= self.max_model_len

    def device_name(self) -> str:
        return str(self.device)

    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.config.eos_token_ids or ())

    def sampling_ops(self) -> KernelOps | None:
        return self.kernel_ops

    def forward_counters(self) -> dict[str, int]:
        replays = self.graph_runner.replays if self.graph_runner is not None else 0
        return {"graph_forwards": int(replays), "eager_forwards": self.eager_forwards}

    def cache_only_blocks(self) -> int:
        return self.prefix_cache.cache_only_blocks() if self.prefix_cache is not None else 0

    # ------------------------------------------------------------------ SSM slots

    def has_ssm_layers(self) -> bool:
        return self.ssm_pool is not None

    def num_free_slots(self) -> int | None:
        return self.ssm_pool.num_free() if self.ssm_pool is not None else None

    def num_total_slots(self) -> int | None:
        return self.ssm_pool.num_slots if self.ssm_pool is not None else None

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        """Move the sequence's conv and SSM state (every recurrent layer) into `new_slot`,
        bit for bit, and free its old slot. `new_slot` is free, or held by a retired sequence
        that `detach_slot_for_reuse` marks slot-less (before or after this call)."""
        if self.ssm_pool is None or seq.ssm_slot is None:
            raise ValueError("compact_sequence needs a sequence holding an SSM slot")
        self.ssm_pool.move(seq.ssm_slot, new_slot)  # type: ignore[arg-type]
        seq.slot_idx = new_slot

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        """Make a retired sequence slot-less without freeing its slot: a survivor has been (or
        is about to be) compacted into it, so releasing it would free a live slot."""
        if seq.ssm_slot is not None:
            seq.ssm_slot.forget()  # type: ignore[attr-defined]
            seq.ssm_slot = None
        seq.slot_idx = DETACHED_SLOT

    def cache_sequence(self, seq: SequenceState) -> None:
        """Index the sequence's fully written blocks in the prefix cache (if there is one)."""
        if self.prefix_cache is None or not seq.block_table:
            return
        valid = min(seq.kv_valid_tokens, seq.seq_len, len(seq.tokens))
        while valid and seq.tokens[valid - 1] == FED_TOKEN:  # a fed step's unknown token
            valid -= 1
        self.prefix_cache.insert(seq.tokens[:valid], seq.block_table, seq.adapter_id)

    def prefix_match_len(self, tokens: Sequence[int], adapter_id: int) -> int:
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.match(tokens, adapter_id).reused

    def lookup_prefix(self, seq: SequenceState, tokens: Sequence[int]) -> int:
        if seq.prefix_lookup_applied:
            return seq.reused_prefix_tokens
        if seq.seq_len or seq.block_table:
            raise ValueError("the prefix lookup must run before the sequence's first chunk")
        seq.prefix_lookup_applied = True
        if self.prefix_cache is None:
            self.prefix_cache_bypasses += self._prefix_bypassed
            return 0
        match = self.prefix_cache.match(tokens, seq.adapter_id)
        if not match.nodes:
            return 0
        blocks = [node.block for node in match.nodes]
        if match.copy_last:
            private = self.block_pool.allocate(1)[0]
            self.kv_cache.copy_block(blocks[-1], private)
            self.block_pool.incref(blocks[:-1])
            seq.block_table = [*blocks[:-1], private]
        else:
            self.block_pool.incref(blocks)
            seq.block_table = blocks
        self.prefix_cache.touch(match.nodes)
        matched = len(blocks) * self.block_size
        seq.tokens = list(tokens[: match.reused])
        seq.seq_len = seq.kv_valid_tokens = match.reused
        seq.cached_prefix_tokens = matched
        seq.cached_prefix_blocks = len(blocks)
        seq.prefix_ref_tokens = list(tokens[:matched])
        seq.reused_prefix_tokens = match.reused
        seq.prefix_lookup_skip = True
        return match.reused

    def reclaim_prefix_blocks(self, n: int) -> int:
        return self.prefix_cache.evict(n) if self.prefix_cache is not None else 0

    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim:
        """Evict until `blocks_needed` are free, never the prefix `prompt` will reuse.
        (`adapter_slot` is the prefix-cache namespace, i.e. the adapter id.)"""
        cache = self.prefix_cache
        short = blocks_needed - self.block_pool.num_free
        if cache is not None and short > 0:
            protected = cache.protected_blocks(prompt, adapter_slot) if prompt else set()
            cache.evict(short, protected)
        return PrefixReclaim(target=blocks_needed, free=self.block_pool.num_free)

    def prefix_cache_stats(self) -> dict[str, int]:
        stats = {"bypassed_lookups": self.prefix_cache_bypasses}
        if self.prefix_cache is not None:
            c = self.prefix_cache.stats
            stats.update(
                evicted_blocks=c.evicted_blocks,
                inserted_blocks=c.inserted_blocks,
                cached_blocks=c.cached_blocks,
            )
        return stats

    def free_sequence(self, seq: SequenceState) -> None:
        if seq.block_table:
            self.block_pool.decref(seq.block_table)
        seq.block_table = []
        seq.seq_len = 0
        seq.tokens = []
        seq.kv_valid_tokens = 0
        if seq.ssm_slot is not None:
            seq.ssm_slot.release()
            seq.ssm_slot = None
        if seq.acquired_adapter_slot >= 0:
            self.release_adapter_slot(seq.acquired_adapter_slot)
            seq.acquired_adapter_slot = -1

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    def blocks_needed(self, seq: SequenceState, new_tokens: int) -> int:
        return blocks_needed(seq, new_tokens, self.block_size)

    def num_total_blocks(self) -> int:
        return self.block_pool.num_usable

    def kv_block_size(self) -> int:
        return self.block_size

    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None:
        """Serialise the sequence's written KV blocks and its SSM slot state (host copies)
        for swap-out."""
        data = self.kv_cache.read_blocks(seq.block_table) if seq.block_table else []
        payload: dict[str, Any] = {"num_blocks": len(seq.block_table), "kv": data}
        slot = seq.ssm_slot_idx()
        if self.ssm_pool is not None and slot is not None:
            payload["ssm"] = self.ssm_pool.read_slot(slot)
        pickle.dump(payload, writer)

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        """Allocate `num_blocks` blocks and fill them from `save_sequence_state` output."""
        payload: dict[str, Any] = pickle.load(reader)
        if payload["num_blocks"] != num_blocks:
            raise ValueError(
                f"swap record holds {payload['num_blocks']} blocks, expected {num_blocks}"
            )
        slot = seq.ssm_slot_idx()
        if self.ssm_pool is not None and (slot is None or "ssm" not in payload):
            raise ValueError("swap-in of a hybrid sequence needs its SSM state and a slot")
        blocks = self.block_pool.allocate(num_blocks)
        if num_blocks:
            self.kv_cache.write_blocks(blocks, payload["kv"])
        seq.block_table = blocks
        if self.ssm_pool is not None and slot is not None:
            self.ssm_pool.write_slot(slot, payload["ssm"])

    # ------------------------------------------------------------------ forward

    def prefill_chunk(
        self,
        tokens: Sequence[int],
        seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last_chunk: bool,
        stream: Stream = None,
    ) -> torch.Tensor | None:
        result = self.mixed_forward_batch(
            [], [], [PrefillSlice(tokens, seq, chunk_start, chunk_len, is_last_chunk)], stream
        )
        return result.prefill_logits[0]

    def decode_batch(
        self, tokens: Sequence[int], seqs: Sequence[SequenceState], stream: Stream = None
    ) -> torch.Tensor:
        result = self.mixed_forward_batch(tokens, seqs, [], stream)
        assert result.decode_logits is not None
        return result.decode_logits

    def prefill_batch_chunk(
        self, slices: Sequence[PrefillSlice], stream: Stream = None
    ) -> list[torch.Tensor | None]:
        return self.mixed_forward_batch([], [], slices, stream).prefill_logits

    def prefill_batch_chunk_rows(
        self, slices: Sequence[PrefillSlice], stream: Stream = None, row_base: int = 0
    ) -> list[torch.Tensor | None]:
        return self.prefill_batch_chunk(slices, stream)

    def mixed_forward_batch(
        self,
        decode_tokens: Sequence[int],
        decode_seqs: Sequence[SequenceState],
        prefill_streams: Sequence[PrefillSlice],
        stream: Stream = None,
    ) -> MixedBatchResult:
        """M decode rows and N prefill chunks in one forward of the architecture module."""
        return self._mixed(decode_tokens, None, decode_seqs, prefill_streams)

    def _mixed(
        self,
        decode_tokens: Sequence[int],
        drafts: Sequence[Sequence[int]] | None,
        decode_seqs: Sequence[SequenceState],
        prefill_streams: Sequence[PrefillSlice],
    ) -> MixedBatchResult:
        """One forward of decode rows (each with its drafts, if any) and prefill chunks."""
        if len(decode_tokens) != len(decode_seqs):
            raise ValueError("decode_tokens and decode_seqs differ in length")
        if drafts is None:
            rows = [ForwardRow(s, [int(t)], True) for t, s in zip(decode_tokens, decode_seqs)]
        else:
            rows = [
                ForwardRow(s, [int(t), *map(int, d)], True, all_logits=bool(d))
                for t, d, s in zip(decode_tokens, drafts, decode_seqs, strict=True)
            ]
        for sl in prefill_streams:
            if sl.chunk_start != sl.seq.seq_len:
                raise ValueError(
                    f"prefill chunk starts at {sl.chunk_start} but the sequence holds {sl.seq.seq_len} tokens"
                )
            if sl.chunk_len < 1 or sl.chunk_start + sl.chunk_len > len(sl.prompt_tokens):
                raise ValueError(
                    f"prefill chunk [{sl.chunk_start}, +{sl.chunk_len}) is outside the prompt"
                )
            chunk = list(sl.prompt_tokens[sl.chunk_start : sl.chunk_start + sl.chunk_len])
            rows.append(
                ForwardRow(
                    sl.seq, chunk, sl.is_last_chunk, sl.seq.collect_prompt_logprobs is not None
                )
            )
        if not rows:
            return MixedBatchResult(None, [])
        self._check_ssm_states(rows)
        self._allocate_blocks(rows)
        # The attention's decode rows: the leading decode rows that carry no drafts (a
        # one-token prefill chunk stays a prefill row, as without speculation).
        num_single = 0
        while num_single < len(decode_seqs) and len(rows[num_single].tokens) == 1:
            num_single += 1
        logits, spans = self._forward(rows, num_single, None)
        nd = len(decode_seqs)
        decode_rows = sum(spans[i][1] for i in range(nd))
        decode_logits = logits[:decode_rows] if decode_seqs else None
        prefill_logits: list[torch.Tensor | None] = []
        for i, sl in enumerate(prefill_streams):
            first, count = spans[nd + i]
            if sl.seq.collect_prompt_logprobs is not None:
                self._score_prompt(sl, logits[first : first + count])
            prefill_logits.append(
                logits[first + count - 1 : first + count] if sl.is_last_chunk else None
            )
        self._advance(rows)
        return MixedBatchResult(decode_logits, prefill_logits)

    # ------------------------------------------------------------------- verify

    def can_batch_verify(self, ks: Sequence[int]) -> bool:
        """Any mix of row counts verifies in one forward, on models without recurrent
        layers (SSM rollback is not built yet)."""
        return self.ssm_pool is None

    def mixed_verify_batch(
        self,
        decode_tokens: Sequence[int],
        drafts: Sequence[Sequence[int]],
        decode_seqs: Sequence[SequenceState],
        prefill_streams: Sequence[PrefillSlice],
        stream: Stream = None,
    ) -> MixedBatchResult:
        if self.ssm_pool is not None and any(drafts):
            raise Unsupported(
                "speculative verify on a hybrid (SSM) model needs recurrent-state rollback, "
                "which this model does not have yet"
            )
        if not prefill_streams and decode_seqs:
            graphed = self._verify_graphed(decode_tokens, drafts, decode_seqs)
            if graphed is not None:
                return MixedBatchResult(graphed, [])
        return self._mixed(decode_tokens, drafts, decode_seqs, prefill_streams)

    def _verify_graphed(
        self,
        decode_tokens: Sequence[int],
        drafts: Sequence[Sequence[int]],
        seqs: Sequence[SequenceState],
    ) -> torch.Tensor | None:
        """A verify-only step replayed from the (batch, Q) graph whose Q covers every row's
        drafts; rows with fewer drafts are padded by repeating their last token, and the
        padding's KV lands past the row's new `seq_len` (blocks taken for it go back at
        once). None when no captured graph fits, or the padding's blocks or context are not
        available: the caller runs the step eagerly."""
        runner = self.graph_runner
        if runner is None or len(decode_tokens) != len(seqs) or len(drafts) != len(seqs):
            return None
        longest = max(len(d) for d in drafts) + 1
        q = next((q for q in runner.query_lens if q >= longest), None)
        if q is None or q == 1 or not runner.can_run(len(seqs), q):
            return None
        if not all(self.fits_context(s, q) for s in seqs):
            return None
        padded = [
            ForwardRow(s, [int(t), *map(int, d), *[int(t)] * (q - 1 - len(d))], True)
            for t, d, s in zip(decode_tokens, drafts, seqs)
        ]
        need = sum(self.blocks_needed(r.seq, q) for r in padded)
        if need > self.block_pool.num_free:
            return None
        self._allocate_blocks(padded)
        tokens = np.asarray([r.tokens for r in padded], dtype=np.int64)
        starts = np.fromiter((s.seq_len for s in seqs), dtype=np.int64, count=len(seqs))
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        with torch.inference_mode():
            logits = runner.run_verify(tokens, starts, tables)
            if all(len(d) + 1 == q for d in drafts):
                selected = logits  # no padding: every row is the graph's rows
            else:
                index = [b * q + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
                host = torch.tensor(index, dtype=torch.int64)
                if logits.device.type == "cuda":
                    host = host.pin_memory()
                selected = logits.index_select(0, host.to(logits.device, non_blocking=True))
        self._last_hidden = None
        rows = [
            ForwardRow(s, [int(t), *map(int, d)], True)
            for t, d, s in zip(decode_tokens, drafts, seqs)
        ]
        self._advance(rows)
        for s in seqs:  # the padding's blocks: nothing past seq_len is kept
            keep = blocks_for(s.seq_len, self.block_size)
            if len(s.block_table) > keep:
                self.block_pool.decref(s.block_table[keep:])
                del s.block_table[keep:]
        return selected

    def decode_verify(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        """`[last_verified, draft0, ...]` through one forward; the argmax at each position.
        The sequence advances by `len(tokens)`; `commit_accepted_prefix` rewinds it."""
        return self.decode_verify_batched(tokens, [len(tokens)], [seq], stream)

    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceState],
        stream: Stream = None,
        opts: VerifyBatchedOpts | None = None,
    ) -> list[int]:
        """Sequence `i` feeds `ks[i]` rows (its last verified token and `ks[i] - 1` drafts),
        flat and sequence-major in `tokens`; returns the argmax id of every row."""
        if len(ks) != len(seqs) or sum(ks) != len(tokens) or any(k < 1 for k in ks):
            raise ValueError("decode_verify_batched: tokens, ks and seqs do not line up")
        firsts: list[int] = []
        drafts: list[list[int]] = []
        offset = 0
        for k in ks:
            firsts.append(int(tokens[offset]))
            drafts.append([int(t) for t in tokens[offset + 1 : offset + k]])
            offset += k
        result = self.mixed_verify_batch(firsts, drafts, seqs, [], stream)
        assert result.decode_logits is not None
        return [int(t) for t in result.decode_logits.argmax(dim=-1).tolist()]

    def commit_accepted_prefix(self, seq: SequenceState, num_accepted: int, k: int) -> None:
        """Keep the last verify's input token and its first `num_accepted` of `k` drafts:
        `seq_len`, `tokens` and `kv_valid_tokens` drop the rejected `k - num_accepted`, and
        blocks past the kept tokens go back to the pool (they were allocated by the verify,
        so nothing shares them). The slots left past `seq_len` are overwritten later."""
        if not 0 <= num_accepted <= k:
            raise ValueError(f"num_accepted {num_accepted} is outside [0, {k}]")
        if k > seq.seq_len:
            raise ValueError(f"cannot roll back {k} drafts of a {seq.seq_len}-token sequence")
        drop = k - num_accepted
        if drop and self.ssm_pool is not None:
            raise Unsupported("rolling back a hybrid (SSM) model's recurrent state")
        if drop:
            seq.seq_len -= drop
            del seq.tokens[seq.seq_len :]
            seq.kv_valid_tokens = min(seq.kv_valid_tokens, seq.seq_len)
        keep = blocks_for(seq.seq_len, self.block_size)
        if len(seq.block_table) > keep:
            self.block_pool.decref(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _advance(self, rows: list[ForwardRow]) -> None:
        for row in rows:
            row.seq.tokens.extend(row.tokens)
            row.seq.seq_len += len(row.tokens)
            row.seq.kv_valid_tokens = row.seq.seq_len
            if self.ssm_pool is not None:
                slot = row.seq.ssm_slot_idx()
                assert slot is not None
                self.ssm_pool.num_tokens[slot] = row.seq.seq_len

    # ------------------------------------------------------------ device token feed

    def supports_device_token_feed(self) -> bool:
        return True

    def decode_batch_fed(
        self,
        sources: Sequence[FeedSource],
        seqs: Sequence[SequenceState],
        stream: Stream = None,
        *,
        feed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A decode step whose input tokens are read on the device: row `i`'s token is
        `feed[sources[i].from_row]`, `feed` being the previous step's sampled token ids
        `[rows]` int64, which the host has not read yet. Returns `[rows, vocab]` logits.

        Unlike the seed (which defers it to the commit), the sequences advance here as after
        any forward (`seq_len`, `kv_valid_tokens`, a block when one fills); `tokens` records
        `FED_TOKEN` at the new position until the scheduler's commit of the previous step
        writes the real id. Every source must be a `from_row` one."""
        if feed is None:
            raise ValueError("decode_batch_fed needs `feed`, the previous step's token ids")
        if len(sources) != len(seqs):
            raise ValueError("sources and seqs differ in length")
        if not seqs:
            raise ValueError("decode_batch_fed needs at least one row")
        from_rows = []
        for src in sources:
            if src.from_row is None or not 0 <= src.from_row < feed.shape[0]:
                raise ValueError(
                    f"a fed row must name a row of the previous step's {feed.shape[0]} tokens "
                    f"(got from_row={src.from_row!r}); host tokens go through decode_batch"
                )
            from_rows.append(src.from_row)
        rows = [ForwardRow(s, [FED_TOKEN], True) for s in seqs]
        self._check_ssm_states(rows)
        self._allocate_blocks(rows)
        logits, _ = self._forward(rows, len(rows), (feed, from_rows))
        self._advance(rows)
        return logits

    def _check_ssm_states(self, rows: list[ForwardRow]) -> None:
        """On hybrid models, each row's slot state must cover exactly its sequence's tokens."""
        pool = self.ssm_pool
        if pool is None:
            return
        seen: set[int] = set()
        for r in rows:
            slot = r.seq.ssm_slot_idx()
            if slot is None:
                raise ValueError("a sequence of a hybrid model has no SSM slot")
            if slot in seen:
                raise ValueError(f"two rows of one forward share SSM slot {slot}")
            seen.add(slot)
            if pool.num_tokens[slot] != r.seq.seq_len:
                raise ValueError(
                    f"SSM slot {slot} holds the state of {pool.num_tokens[slot]} tokens but the "
                    f"sequence continues at {r.seq.seq_len}; a KV prefix cannot be reused "
                    "without its recurrent state"
                )

    def _allocate_blocks(self, rows: list[ForwardRow]) -> None:
        needs = [self.blocks_needed(r.seq, len(r.tokens)) for r in rows]
        for r in rows:
            if not self.fits_context(r.seq, len(r.tokens)):
                raise InvalidRequestError(
                    f"sequence would reach {r.seq.seq_len + len(r.tokens)} tokens, over "
                    f"max_model_len {self.max_model_len}"
                )
        total = sum(needs)
        if total > self.block_pool.num_free:
            raise KVCacheExhausted(
                f"KV cache exhausted: this forward needs {total} blocks, {self.block_pool.num_free} free"
            )
        for r, n in zip(rows, needs):
            if n:
                r.seq.block_table.extend(self.block_pool.allocate(n))

    @torch.inference_mode()
    def _forward(
        self,
        rows: list[ForwardRow],
        num_decode: int,
        feed: tuple[torch.Tensor, list[int]] | None,
    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """`feed`: (previous step's token ids on the device, source row of each decode row);
        those rows' input ids are read from it on the device."""
        runner = self.graph_runner
        if runner is not None and num_decode == len(rows) and runner.can_run(num_decode):
            spans = [(i, 1) for i in range(len(rows))]
            return self._forward_graphed(runner, rows, feed), spans
        self.eager_forwards += 1
        batch = build_forward_batch(rows, num_decode, self.block_size, self.device)
        if feed is not None:
            tokens, from_rows = feed
            index = torch.tensor(from_rows, dtype=torch.int64).to(self.device, non_blocking=True)
            batch.input_ids[: len(from_rows)] = tokens.index_select(0, index)
        if self.ssm_pool is not None:
            hidden = self.module(
                batch.input_ids, batch.meta.positions, batch.meta, self.kv_cache.layers,
                ssm_states=self.ssm_pool.layers,
            )  # fmt: skip
        else:
            hidden = self.module(
                batch.input_ids, batch.meta.positions, batch.meta, self.kv_cache.layers
            )
        selected = hidden.index_select(0, batch.logits_indices)
        self._last_hidden = selected
        return self.module.compute_logits(selected).float(), batch.logits_spans

    def _forward_graphed(
        self,
        runner: DecodeGraphRunner,
        rows: list[ForwardRow],
        feed: tuple[torch.Tensor, list[int]] | None,
    ) -> torch.Tensor:
        """A decode-only forward replayed from the captured graph of its padded width."""
        if feed is not None:
            tokens = np.asarray(feed[1], dtype=np.int64)  # source rows, gathered on device
        else:
            tokens = np.fromiter((r.tokens[0] for r in rows), dtype=np.int64, count=len(rows))
        positions = np.fromiter((r.seq.seq_len for r in rows), dtype=np.int64, count=len(rows))
        width = max(len(r.seq.block_table) for r in rows)
        tables = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            tables[i, : len(r.seq.block_table)] = r.seq.block_table
        self._last_hidden = None
        return runner.run(tokens, positions, tables, feed[0] if feed is not None else None)

    def _score_prompt(self, sl: PrefillSlice, logits: torch.Tensor) -> None:
        """Append one PromptTokenLogprob per chunk position that has a next prompt token."""
        k = sl.seq.collect_prompt_logprobs or 0
        targets = list(sl.prompt_tokens[sl.chunk_start + 1 : sl.chunk_start + sl.chunk_len + 1])
        if not targets:
            return
        n = len(targets)
        logprobs = torch.log_softmax(logits[:n].float(), dim=-1)
        target_ids = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
        chosen = logprobs.gather(1, target_ids).squeeze(1)
        ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
        chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
        top_v = top_vals.tolist() if top_vals is not None else None
        top_i = top_ids.tolist() if top_ids is not None else None
        for j in range(n):
            top = list(zip(top_i[j], top_v[j])) if top_i is not None and top_v is not None else []
            sl.seq.prompt_logprobs.append(
                PromptTokenLogprob(targets[j], chosen_l[j], ranks_l[j], top)
            )

    # ------------------------------------------------------------------- logits

    def vocab_size(self) -> int:
        return self.config.vocab_size

    def hidden_after_norm(self) -> torch.Tensor | None:
        return self._last_hidden

    def logits_buffer_ptr(self) -> torch.Tensor | None:
        return None
