"""`TransformerModel`: the `Model` implementation that binds an architecture module to the paged
KV cache, the block pool, batch metadata and the logits of each forward.

Owner: model-engine. The scheduler drives it only through the `Model` interface. This module
holds the forward passes; the KV lifecycle between forwards (prefix cache, release, block
counts, swap) is the `PagedKvLifecycle` mixin (`kv_lifecycle.py`), speculative verify the
`VerifyForwards` mixin (`verify.py`), the device token feed and decode-graph replays the
`FastForwards` mixin (`fast_forwards.py`), each with its own invariants; prompt pooling and
prompt logprobs are `prompt_outputs.py`'s.

Invariants:
- Every forward (decode rows, prefill chunks or both) is one call of the architecture module.
  Blocks for all rows are allocated before it runs, all or nothing: on `KVCacheExhausted` no
  sequence has changed.
- After a forward each row's sequence has `tokens` extended by the row's tokens, `seq_len`
  advanced by the same count and `kv_valid_tokens == seq_len`.
- Logits rows are float32 `[rows, vocab_size]`.
- A fed decode step (`decode_batch_fed`, the device token feed) advances its sequences like
  any forward but records `FED_TOKEN` in `tokens` at the new position; the scheduler's commit
  of the previous step overwrites it, and `cache_sequence` never indexes a position holding it.
- LoRA (`LoraAdapters`, `lora.py`): a forward routes each row to its sequence's
  `adapter_slot` (-1: the base model) for the duration of the module call only; decode and
  verify graphs captured with the LoRA slots replay adapter rows (their slots a graph input),
  graphs captured without them never do (those steps run eagerly, counted in
  `lora_eager_forwards`).
- No forward takes a sequence past `max_model_len` (`fits_context`, the model's one check).
- With the MTP head drafting (`mtp=True`), every eager forward keeps its rows' hidden states
  for the head (`MtpDrafting`, `mtp.py`); the KV cache holds the head's layers after the main
  model's, and the main model only ever sees its own.
- Vision models: a forward whose rows carry images gets M-RoPE positions and the encoder rows
  of the image pad tokens it covers (`VisionForwards`, `vision.py`, with its invariants).
- Hybrid models (an SSM slot pool is given): every live sequence holds one pool slot from
  `alloc_sequence` until `free_sequence` (its guard also returns it if the state is dropped),
  `slot_idx` names it, and a forward refuses a row whose slot state does not cover exactly the
  tokens before the row (so a KV prefix without its recurrent state is never used silently).
  Nothing compacts slots: the pool hands out the lowest free slot and a slot index is only an
  index into preallocated tensors (batches gather by index), so fragmented slots cost nothing;
  `compact_sequence` exists for the seed's interface and keeps a verify stash with its state.
- Hybrid models with prefix caching keep an SSM snapshot store (`snapshots`,
  `ssm_snapshot_slots` slots; `ssm_prefix.py`): a lookup restores a snapshot before reusing any
  KV, and every forward ends by snapshotting the rows that reached a capture point or a decode
  block boundary. With no slots the cache is bypassed, with a start-up warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from metrale.cache.block_pool import BlockPool
from metrale.cache.hss import HostKvPool
from metrale.cache.kv_cache import PagedKVCache
from metrale.cache.kv_tiers import KvTiers
from metrale.cache.radix import RadixPrefixCache
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.cache.ssm_snapshots import SnapshotCost, SsmSnapshotStore
from metrale.errors import InvalidRequestError, KVCacheExhausted
from metrale.kernels import KernelOps
from metrale.kernels.cpu_decode import CpuDecodeStack
from metrale.model_engine.batch import ForwardRow, build_forward_batch
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from metrale.model_engine.fast_forwards import FastForwards, fed_ids
from metrale.model_engine.kv_lifecycle import PagedKvLifecycle
from metrale.model_engine.lora import LoraAdapters
from metrale.model_engine.mtp import MtpDrafting, require_mtp_head
from metrale.model_engine.prompt_outputs import pool_prompt_rows, score_prompt
from metrale.model_engine.ssm_prefix import SsmPrefixCaching
from metrale.model_engine.ssm_slots import SsmSlots
from metrale.model_engine.ssm_verify import SsmVerifyStash
from metrale.model_engine.traits import (
    MixedBatchResult,
    Model,
    PrefillSlice,
    SequenceState,
    Stream,
    blocks_needed,
)
from metrale.model_engine.verify import VerifyForwards
from metrale.model_engine.vision import VisionForwards
from metrale.models.config import ModelConfig

logger = logging.getLogger(__name__)

__all__ = ["TransformerModel", "blocks_needed"]


def snapshot_cost(module: torch.nn.Module, config: ModelConfig) -> SnapshotCost:
    """The recompute cost the snapshot store weighs snapshots by: 2 flops per parameter per
    token, plus attention's 4 flops per head dimension per context position per KV layer."""
    params = sum(p.numel() for p in module.parameters())
    width = config.num_attention_heads * config.head_dim
    return SnapshotCost(linear=2.0 * params, attention=4.0 * width * module.kv_layer_count)


class TransformerModel(
    FastForwards,
    VisionForwards,
    PagedKvLifecycle,
    SsmPrefixCaching,
    SsmSlots,
    VerifyForwards,
    MtpDrafting,
    LoraAdapters,
    Model,
):
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
        mtp: bool = False,
        ssm_snapshot_slots: int = 0,
    ) -> None:
        self.module = module
        if mtp:
            require_mtp_head(module, config.architecture)
        head_layers = module.mtp.kv_layer_count if mtp else 0
        if kv_cache.num_layers != module.kv_layer_count + head_layers:
            raise ValueError(
                f"the KV cache holds {kv_cache.num_layers} layers; the model needs "
                f"{module.kv_layer_count} (+{head_layers} for its MTP head)"
            )
        self.mtp_enabled = mtp
        self._vision_setup()
        self.mtp_graphs = {}
        self.mtp_proposes = {"graphed": 0, "eager": 0}
        self.ssm_pool = ssm_pool
        self.ssm_stash = SsmVerifyStash(ssm_pool) if ssm_pool is not None else None
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
        #: The CPU's fused decode step (`kernels/cpu_decode.py`, set by the factory); None:
        #: every forward layer by layer.
        self.cpu_decode: CpuDecodeStack | None = None
        #: Decode steps a graph would have run, run eagerly because a row uses an adapter.
        self.lora_eager_forwards = 0
        #: One-token prompt chunks run by a decode graph replay (`_graphable_chunks`).
        self.graphed_prompt_chunks = 0
        #: op name -> "torch" | "triton" | "triton+pdl", as the factory selected them.
        self.kernel_implementations: dict[str, str] = {}
        #: The op set the factory built the layers with (the engine's sampler uses its
        #: `argmax` / `top_k_top_p_sample`); None when built outside the factory.
        self.kernel_ops: KernelOps | None = None
        self._last_hidden: torch.Tensor | None = None
        self.prefix_cache: RadixPrefixCache | None = None
        #: High-speed swap's host blocks (`attach_high_speed_swap`); None: all blocks resident.
        self.hss: HostKvPool | None = None
        self.hss_window = 0
        #: The prefix cache's host / disk tiers (`attach_kv_tiers`); None: evicted KV is gone.
        self.kv_tiers: KvTiers | None = None
        #: Hybrid models with prefix caching: the recurrent-state snapshots a hit restores.
        self.snapshots: SsmSnapshotStore | None = None
        #: Lookups refused because a KV hit cannot be used on this model (hybrid SSM state).
        self.prefix_cache_bypasses = 0
        self._prefix_bypassed = (
            enable_prefix_caching and self.has_ssm_layers() and ssm_snapshot_slots < 1
        )
        if self._prefix_bypassed:
            logger.warning(
                "prefix caching is bypassed: this model keeps recurrent (SSM) state and "
                "ssm_snapshot_slots is 0, so a KV prefix hit cannot restore it; every prompt is "
                "computed in full"
            )
        elif enable_prefix_caching:
            if ssm_pool is not None:
                self.snapshots = SsmSnapshotStore(
                    ssm_pool.specs, ssm_snapshot_slots, ssm_pool.conv_dtype, ssm_pool.device,
                    snapshot_cost(module, config),
                )  # fmt: skip
            self.prefix_cache = RadixPrefixCache(self.block_pool, self.block_size, self.snapshots)

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
        counters = {"graph_forwards": int(replays), "eager_forwards": self.eager_forwards}
        if self.graph_runner is not None:
            counters["graphed_prompt_chunks"] = self.graphed_prompt_chunks
        if self.lora is not None:
            counters["lora_eager_forwards"] = self.lora_eager_forwards
        if self.mtp_enabled:
            counters["mtp_graphed_proposes"] = self.mtp_proposes["graphed"]
            counters["mtp_eager_proposes"] = self.mtp_proposes["eager"]
        if self.kernel_ops is not None:  # the CPU projections' calls by path
            counters.update(self.kernel_ops.counters())
        if self.cpu_decode is not None:
            counters["cpu_fused_decode_forwards"] = self.cpu_decode.fused_forwards
        return counters

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
                    sl.seq,
                    chunk,
                    sl.is_last_chunk,
                    sl.seq.collect_prompt_logprobs is not None,
                    prefill=True,
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
        capture = self._begin_recurrent_verify(rows, num_single, len(decode_seqs))
        logits, spans = self._forward(rows, num_single, None)
        nd = len(decode_seqs)
        decode_rows = sum(spans[i][1] for i in range(nd))
        decode_logits = logits[:decode_rows] if decode_seqs else None
        prefill_logits: list[torch.Tensor | None] = []
        for i, sl in enumerate(prefill_streams):
            first, count = spans[nd + i]
            if sl.seq.collect_prompt_logprobs is not None:
                score_prompt(sl, logits[first : first + count])
            prefill_logits.append(
                logits[first + count - 1 : first + count] if sl.is_last_chunk else None
            )
        self._advance(rows)
        self._end_recurrent_verify(capture)
        self._capture_after_forward(rows)
        return MixedBatchResult(decode_logits, prefill_logits)

    def _advance(self, rows: list[ForwardRow]) -> None:
        for row in rows:
            row.seq.tokens.extend(row.tokens)
            row.seq.seq_len += len(row.tokens)
            row.seq.kv_valid_tokens = row.seq.seq_len
            if self.hss is not None:
                self._hss_offload(row.seq)
            if self.ssm_pool is not None:
                slot = row.seq.ssm_slot_idx()
                assert slot is not None
                self.ssm_pool.num_tokens[slot] = row.seq.seq_len

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
        if runner is not None and runner.can_run(len(rows)):
            adapters_ok = runner.lora is not None or all(r.seq.adapter_slot < 0 for r in rows)
            if num_decode < len(rows) and adapters_ok and self._graphable_chunks(rows, feed):
                # One-token prompt chunks (with any decode rows) replay the decode graph.
                self.graphed_prompt_chunks += len(rows) - num_decode
                return self._forward_graphed(runner, rows, feed), [(i, 1) for i in range(len(rows))]
            if num_decode == len(rows):
                if adapters_ok:
                    spans = [(i, 1) for i in range(len(rows))]
                    return self._forward_graphed(runner, rows, feed), spans
                self.lora_eager_forwards += 1
        self.eager_forwards += 1
        hidden = self._fused_decode_rows(rows, num_decode, feed)
        if hidden is not None:  # the CPU's fused step, straight from the rows' host lists
            self._last_hidden = hidden
            return self.module.compute_logits(hidden).float(), [(i, 1) for i in range(len(rows))]
        batch = build_forward_batch(rows, num_decode, self.block_size, self.device)
        if batch.lora is not None and self.lora is None:
            raise ValueError("a row selects a LoRA slot but the model serves no adapters")
        if feed is not None:  # the decode rows come first
            ids = fed_ids(*feed)
            if ids.shape[0] == batch.input_ids.shape[0]:
                batch.input_ids = ids
            else:
                batch.input_ids[: ids.shape[0]] = ids
        batch.meta.host_kv = self.hss
        if self.hss is not None and self.hss.cuda:  # the Triton kernels read device blocks
            tables = [r.seq.block_table for r in rows]
            batch.meta.host_kv = (
                self.hss.staging(tables, batch.meta.seq_lens_host, self.device)
                if any(b < 0 for t in tables for b in t)
                else None
            )
        positions, kwargs = self._vision_batch(rows, batch.meta.positions)
        args = (batch.input_ids, positions, batch.meta, self.main_kv_layers)
        if self.ssm_pool is not None:
            kwargs["ssm_states"] = self.ssm_pool.layers
        if self.lora is not None:
            self.lora.slots.batch = self.lora.slots.route(batch.lora)
        fused = self.cpu_decode
        if (
            fused is not None
            and num_decode == len(rows)
            and not kwargs
            and not self.mtp_enabled
            and self.lora is None
            and fused.takes(batch.meta, len(rows))
        ):
            hidden = fused(batch.input_ids, batch.meta)  # every layer in one C call
        else:
            try:
                if self.mtp_enabled:
                    hidden, for_head = self.module.forward_for_mtp(*args, **kwargs)
                else:
                    hidden = self.module(*args, **kwargs)
            finally:
                if self.lora is not None:
                    self.lora.slots.batch = None
        if self.mtp_enabled:
            self._keep_mtp_rows(rows, for_head, owned=True)
            self._mtp_prefill_catch_up([r for r in rows if r.prefill])
        if any(r.prefill and r.seq.pooling is not None for r in rows):
            pool_prompt_rows(rows, hidden)
        if batch.logits_every_row:
            selected = hidden
        else:
            selected = hidden.index_select(0, batch.logits_indices)
        self._last_hidden = selected
        return self.module.compute_logits(selected).float(), batch.logits_spans

    # ------------------------------------------------------------------- logits

    def vocab_size(self) -> int:
        return self.config.vocab_size

    def prefill_twophase(
        self, tokens: Sequence[int], seq: SequenceState, chunk_size: int, stream: Stream = None
    ) -> torch.Tensor:
        """Prefill `tokens` in chunks of at most `chunk_size` that end at the prompt's capture
        points (`prefill_capture_point`: its tail split, its branch point), where the recurrent
        state is snapshotted; returns the last position's `[1, vocab]` logits."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        logits = None
        while seq.seq_len < len(tokens):
            start = seq.seq_len
            end = min(len(tokens), start + chunk_size)
            point = self.prefill_capture_point(seq)
            if point is not None and start < point < end:
                end = point
            logits = self.prefill_chunk(tokens, seq, start, end - start, end == len(tokens))
        if logits is None:
            raise ValueError("prefill_twophase needs at least one token past seq_len")
        return logits

    def hidden_after_norm(self) -> torch.Tensor | None:
        return self._last_hidden

    def logits_buffer_ptr(self) -> torch.Tensor | None:
        return None
