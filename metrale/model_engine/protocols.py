"""The core `Model` protocols: streams, lifecycle, forward passes and logits (the seed's
`ModelStreams`, `ModelLifecycle`, `ModelForward`, `ModelLogits`).

Owner: model-engine. Re-exported by `metrale.model_engine.traits`.

Invariants:
- Defaults are the seed's: a neutral value or an `Unsupported` error naming the method.
- No torch import at module level (the scheduler core imports these through traits).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, BinaryIO

from metrale.errors import Unsupported
from metrale.model_engine.sequence import (
    BeamReq,
    MixedBatchResult,
    MixedForwardResult,
    PrefillSlice,
    PrefixReclaim,
    SequenceState,
    Stream,
    Tensor,
)


def _unsupported(method: str) -> Unsupported:
    return Unsupported(f"this model does not support {method}")


class ModelStreams:
    """Streams, events and host sync. Defaults: the default stream, no-ops."""

    def default_stream(self) -> Stream:
        return None

    def create_stream(self) -> Stream:
        return None

    def create_event(self) -> Any:
        return None

    def record_event(self, event: Any, stream: Stream = None) -> None:
        return None

    def stream_wait_event(self, stream: Stream, event: Any) -> None:
        return None

    def synchronize(self, stream: Stream = None) -> None:
        return None


class ModelLifecycle(ABC):
    """Teardown, sequence allocation and release, swap, KV pool counts."""

    def teardown(self) -> None:
        """Free owned device memory, once, at shutdown."""
        return None

    def poll_innerq(self) -> None:
        """Poll the KV-quantization calibration driver; nothing to do without one."""
        return None

    def high_speed_swap_dims(self) -> Any | None:
        """Model dims for KV block streaming; None means unsupported."""
        return None

    def bind_gpu_to_thread(self) -> None:
        """Bind the device context to the calling thread (a no-op where torch does it)."""
        return None

    def max_context_len(self) -> int | None:
        """Most tokens (prompt + output) one sequence may hold: the model's `max_model_len`
        (a metrale extension; the engine validates requests against it). None: no limit of
        its own (the engine uses `EngineConfig.max_model_len`)."""
        return None

    def device_name(self) -> str | None:
        """The device the model runs on ("cpu", "cuda", "cuda:1"); None: not known."""
        return None

    def dtype_name(self) -> str | None:
        """The weights' dtype ("float32", "bfloat16"...); None: not known."""
        return None

    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence ids the checkpoint's config names (the tokenizer may add more)."""
        return frozenset()

    def sampling_ops(self) -> Any | None:
        """The kernel op set the engine's sampler should use (`argmax`,
        `top_k_top_p_sample`); None: the sampler's torch reference ops."""
        return None

    def forward_counters(self) -> dict[str, int]:
        """Forwards replayed from a CUDA graph (`graph_forwards`) and run eagerly
        (`eager_forwards`), and on the CPU the projections' calls by path
        (`cpu_projection_<path>`), for metrics; empty when the model does not count them."""
        return {}

    def cache_only_blocks(self) -> int:
        """KV blocks held only by the prefix cache (reclaimable on demand); walks the cache."""
        return 0

    @abstractmethod
    def alloc_sequence(self) -> SequenceState:
        """A new sequence with its layer states (takes an SSM slot on hybrid models)."""

    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState:
        """The seed's sized allocation; same as `alloc_sequence` here. The scheduler calls
        `alloc_sequence`: KV blocks are taken a forward at a time (`blocks_needed`), so no
        model of this engine sizes a sequence up front, and `add` already refuses a request
        whose peak the pool could never hold."""
        return self.alloc_sequence()

    @abstractmethod
    def cache_sequence(self, seq: SequenceState) -> None:
        """Offer the sequence's written KV to the prefix cache; call before `free_sequence`."""

    @abstractmethod
    def free_sequence(self, seq: SequenceState) -> None:
        """Release KV blocks, prefix-cache refs, SSM slot and adapter slot, exactly once."""

    def compact_sequence(self, seq: SequenceState, new_slot: int) -> None:
        raise _unsupported("compact_sequence")

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        raise _unsupported("detach_slot_for_reuse")

    def save_sequence_state(self, seq: SequenceState, writer: BinaryIO) -> None:
        raise Unsupported("swap not supported")

    def restore_sequence_state(self, seq: SequenceState, num_blocks: int, reader: BinaryIO) -> None:
        raise Unsupported("swap not supported")

    def num_free_blocks(self) -> int:
        """Free KV blocks; 0 with `num_total_blocks() == 0` means no pool."""
        return 0

    def blocks_needed(self, seq: SequenceState, new_tokens: int) -> int:
        """KV blocks `seq` must add to hold `new_tokens` more tokens (a metrale extension):
        what a forward of that many rows allocates. 0 without a paged KV pool."""
        return 0

    def num_total_blocks(self) -> int:
        return 0

    def num_free_slots(self) -> int | None:
        """Free sequence slots of the SSM slot pool; None when the model has no pool (then
        only `max_num_seqs` bounds the running sequences). A metrale extension: admission
        counts slots with it."""
        return None

    def resident_blocks_limit(self) -> int | None:
        """Device blocks a sequence keeps between forwards when older ones live elsewhere
        (high-speed swap); None: a sequence keeps all its blocks."""
        return None

    def num_total_slots(self) -> int | None:
        """Size of the SSM slot pool; None without one. `max_num_seqs` may not exceed it."""
        return None

    def prefix_match_len(self, tokens: Sequence[int], adapter_id: int) -> int:
        """Tokens of `tokens` a prefix-cache lookup would reuse, without taking refs.

        A metrale extension of the seed's chunk-0 lookup, split in two so admission can count
        blocks before committing. Never all of `tokens`: the last one is always recomputed.
        """
        return 0

    def lookup_prefix(self, seq: SequenceState, tokens: Sequence[int]) -> int:
        """The chunk-0 prefix lookup: take refs on the matched blocks, put them in
        `seq.block_table`, advance `seq.seq_len` past the reused tokens and return how many
        tokens were reused (`seq.reused_prefix_tokens`). Replayed, not repeated, when
        `seq.prefix_lookup_applied` is set."""
        return 0

    def prefix_cache_stats(self) -> dict[str, int]:
        """Prefix-cache counters for metrics (a metrale extension); empty without a cache."""
        return {}

    def reclaim_prefix_blocks(self, n: int) -> int:
        """Evict up to `n` prefix-cache blocks; returns how many were freed (0: none)."""
        return 0

    def reclaim_prefix_blocks_for(
        self, prompt: Sequence[int], adapter_slot: int, blocks_needed: int
    ) -> PrefixReclaim:
        """Reclaim until free blocks cover `blocks_needed` for a prefill of `prompt`."""
        while self.num_free_blocks() < blocks_needed:
            if self.reclaim_prefix_blocks(blocks_needed - self.num_free_blocks()) == 0:
                break
        return PrefixReclaim(target=blocks_needed, free=self.num_free_blocks())


class ModelForward(ModelStreams, ABC):
    """Prefill, decode, mixed passes, beam search and shape queries."""

    def supports_beam(self) -> bool:
        return False

    def generate_beam_batch(self, reqs: Sequence[BeamReq]) -> list[list[int]]:
        raise _unsupported("beam search")

    def prefill(self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None) -> Tensor:
        """Whole prompt in one pass; returns the last position's `[1, vocab]` logits."""
        logits = self.prefill_chunk(
            tokens, seq, seq.seq_len, len(tokens) - seq.seq_len, True, stream
        )
        assert logits is not None
        return logits

    @abstractmethod
    def prefill_chunk(
        self,
        tokens: Sequence[int],
        seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last_chunk: bool,
        stream: Stream = None,
    ) -> Tensor | None:
        """One chunk of `tokens`; only the last chunk returns `[1, vocab]` logits."""

    def decode(self, token: int, seq: SequenceState, stream: Stream = None) -> Tensor:
        return self.decode_batch([token], [seq], stream)

    @abstractmethod
    def decode_batch(
        self, tokens: Sequence[int], seqs: Sequence[SequenceState], stream: Stream = None
    ) -> Tensor:
        """One step per sequence; `[n, vocab]` logits, row i for `seqs[i]`."""

    def mixed_forward(
        self,
        decode_tokens: Sequence[int],
        decode_seqs: Sequence[SequenceState],
        prefill_tokens: Sequence[int],
        prefill_seq: SequenceState,
        chunk_start: int,
        chunk_len: int,
        is_last: bool,
        stream: Stream = None,
    ) -> MixedForwardResult:
        decode_logits = (
            self.decode_batch(decode_tokens, decode_seqs, stream) if decode_seqs else None
        )
        prefill_logits = self.prefill_chunk(
            prefill_tokens, prefill_seq, chunk_start, chunk_len, is_last, stream
        )
        return MixedForwardResult(decode_logits, prefill_logits)

    def prefill_batch_chunk(
        self, slices: Sequence[PrefillSlice], stream: Stream = None
    ) -> list[Tensor | None]:
        return [
            self.prefill_chunk(
                s.prompt_tokens, s.seq, s.chunk_start, s.chunk_len, s.is_last_chunk, stream
            )
            for s in slices
        ]

    def prefill_batch_chunk_rows(
        self, slices: Sequence[PrefillSlice], stream: Stream = None, row_base: int = 0
    ) -> list[Tensor | None]:
        return self.prefill_batch_chunk(slices, stream)

    def mixed_forward_batch(
        self,
        decode_tokens: Sequence[int],
        decode_seqs: Sequence[SequenceState],
        prefill_streams: Sequence[PrefillSlice],
        stream: Stream = None,
    ) -> MixedBatchResult:
        decode_logits = (
            self.decode_batch(decode_tokens, decode_seqs, stream) if decode_seqs else None
        )
        self.synchronize(self.default_stream())
        prefill_logits = self.prefill_batch_chunk_rows(prefill_streams, stream, len(decode_seqs))
        return MixedBatchResult(decode_logits, list(prefill_logits))

    def normalize_ssm_states(self, seq: SequenceState, stream: Stream = None) -> None:
        return None

    def prefill_twophase(
        self, tokens: Sequence[int], seq: SequenceState, chunk_size: int, stream: Stream = None
    ) -> Tensor:
        return self.prefill(tokens, seq, stream)

    def is_mla(self) -> bool:
        return False

    def hc_mult(self) -> int:
        return 0

    def kv_block_size(self) -> int | None:
        return None

    def prefill_tail_split(self, tokens: Sequence[int]) -> int | None:
        return None


class ModelLogits(ABC):
    """Reading forward outputs. Logits are torch tensors on the model's device."""

    @abstractmethod
    def vocab_size(self) -> int: ...

    def copy_logits_to_host(self, logits: Tensor, dst: Any = None) -> Any:
        return logits.float().cpu()

    def logits_ptr_is_fp32(self, logits: Tensor) -> bool:
        import torch

        return logits.dtype == torch.float32

    def logits_buffer_ptr(self) -> Tensor | None:
        raise _unsupported("logits_buffer_ptr")

    def argmax_on_device(self, logits: Tensor, stream: Stream = None) -> int:
        return int(logits.reshape(-1, logits.shape[-1])[0].argmax().item())

    def argmax_batch(self, logits: Tensor, n: int, stream: Stream = None) -> list[int]:
        return [int(t) for t in logits[:n].argmax(dim=-1).tolist()]

    def argmax_batch_masked(
        self, logits: Tensor, n: int, masks: Sequence[Sequence[int]], stream: Stream = None
    ) -> list[int] | None:
        return None

    def hidden_after_norm(self) -> Tensor | None:
        raise _unsupported("hidden_after_norm")

    def decode_logits_fp32(self) -> bool:
        return False

    def decode_logits_ptr(self) -> Tensor | None:
        raise _unsupported("decode_logits_ptr")
