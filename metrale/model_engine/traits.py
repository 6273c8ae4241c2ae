"""The model-engine interface: `SequenceState`, the pass I/O types and the `Model` protocols.

This module mirrors `spec/traits.rs` of the seed (Metrale's Rust engine) in Python, with the
seed's names. A `DevicePtr` becomes a `torch.Tensor` (None for NULL) and a `stream: u64`
becomes an optional torch stream (None for the default stream).

Owner: model-engine. The scheduler reaches a model only through the classes here, so a test
model can stand in for a real one.

Invariants:
- Importing this module never imports torch: the scheduler core is pure Python.
- Each capability a model lacks keeps the seed's default: a neutral value (False, 0, None, an
  empty list) or an `Unsupported` error that names the method. No default silently drops work.
- Methods the seed marks **required** are abstract only where every model must provide them to
  be driven by the scheduler (`alloc_sequence`, `cache_sequence`, `free_sequence`,
  `prefill_chunk`, `decode_batch`, `vocab_size`); the other required-in-the-seed methods refuse
  with `Unsupported` until a model implements them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from metrale.errors import Unsupported

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    Tensor = torch.Tensor
else:
    Tensor = Any

Stream = Any  # a torch.cuda.Stream, or None for the default stream

#: Batched decode pads to one of these widths so CUDA graphs are keyed by a few shapes.
DECODE_BATCH_LADDER: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def padded_batch_n(n: int) -> int:
    """The smallest rung of `DECODE_BATCH_LADDER` that is >= n, or n itself above the ladder."""
    if n < 0:
        raise ValueError(f"batch size must be >= 0, got {n}")
    for rung in DECODE_BATCH_LADDER:
        if rung >= n:
            return rung
    return n


# --------------------------------------------------------------------------------------------
# Pass I/O types
# --------------------------------------------------------------------------------------------


@dataclass
class MixedForwardResult:
    """Result of a mixed forward pass (decode rows plus one prefill chunk)."""

    #: `[N, vocab]` logits for the decode sequences; None when there are none.
    decode_logits: Tensor | None
    #: `[1, vocab]` logits for the prefill sequence's last token; None unless its last chunk.
    prefill_logits: Tensor | None


@dataclass
class MixedBatchResult:
    """Result of a batched mixed forward pass: M decode rows plus N prefill chunks."""

    #: `[M, vocab]` logits for the decode rows; None when there are none.
    decode_logits: Tensor | None
    #: One entry per prefill stream, in input order: `[1, vocab]` when that stream's chunk was
    #: its last, None otherwise.
    prefill_logits: list[Tensor | None]


@dataclass
class PrefillSlice:
    """One prefilling stream's chunk; several run in one forward pass."""

    #: The stream's full known token list (prompt, plus generated tokens on a resume).
    prompt_tokens: Sequence[int]
    seq: SequenceState
    #: Offset into `prompt_tokens` where this chunk starts.
    chunk_start: int
    chunk_len: int
    #: Whether this is the stream's final chunk, which produces its last-token logits.
    is_last_chunk: bool


@dataclass
class ChunkedPrefillPageMetadata:
    """Per-sequence device copies of paged metadata kept across prefill chunks."""

    block_table: Tensor | None
    seq_len: Tensor | None
    block_capacity: int = 0
    uploaded_blocks: int = 0


@dataclass
class PromptTokenLogprob:
    """The score of prompt token `i + 1` given the prompt up to position `i`."""

    #: The prompt token that was scored (`tokens[i + 1]`).
    token_id: int
    logprob: float
    #: 1-based rank of `token_id` among all vocabulary entries at that position.
    rank: int
    #: The position's top alternatives, best first: (token id, logprob).
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class BeamReq:
    """One NLLB beam-search request."""

    prompt_tokens: list[int]
    src_lang_id: int = 0
    tgt_lang_id: int = 0
    adapter_slot: int = -1
    num_beams: int = 1
    max_new: int = 0
    length_penalty: float = 1.0
    early_stopping: bool = False


@dataclass
class VerifyBatchedOpts:
    """Options of a batched verify; `write_on_accept` asks GDN layers for write-on-accept."""

    write_on_accept: bool = False


@dataclass
class PrefixReclaim:
    """Result of reclaiming prefix-cache blocks; `free < target` means nothing more was
    evictable."""

    target: int
    free: int


@dataclass
class ForwardDisclosure:
    """What a benchmark record states about the forward that decode runs."""

    forward: str = "legacy"
    plan_digest: str = ""
    launches_per_step: int = 0


@dataclass
class ForwardSelect:
    """`Legacy` (hand-written layer loops) or a compiled `Circuit` program."""

    kind: str = "legacy"
    config_json: str | None = None


@dataclass
class FeedSource:
    """Input id of a fed decode row: the previous step's on-device argmax of `from_row`, or a
    host token."""

    from_row: int | None = None
    host_token: int | None = None


class SlotGuardLike(Protocol):
    """What `SequenceState.ssm_slot` holds: a slot that is released exactly once."""

    def idx(self) -> int | None: ...

    def release(self) -> None: ...


# --------------------------------------------------------------------------------------------
# SequenceState
# --------------------------------------------------------------------------------------------

#: `slot_idx` value of a sequence whose slot was detached (`usize::MAX` in the seed).
DETACHED_SLOT = -1


@dataclass(eq=False)
class SequenceState:
    """One sequence's state across prefill and decode. Field meanings follow the seed."""

    #: Prompt and generated token ids processed so far (their KV is written).
    tokens: list[int] = field(default_factory=list)
    #: Physical KV blocks of the paged cache, in logical order.
    block_table: list[int] = field(default_factory=list)
    seq_len: int = 0
    #: Per-layer opaque state (recurrent layers keep theirs in the SSM pool instead).
    layer_states: list[Any] = field(default_factory=list)
    #: The draft proposer's per-sequence state; None without a proposer.
    proposer_state: Any = None
    #: Pool slot of this sequence; `DETACHED_SLOT` after `detach_slot_for_reuse`.
    slot_idx: int = 0
    #: Guard that returns the SSM pool slot exactly once; None for models without an SSM pool.
    ssm_slot: SlotGuardLike | None = None
    #: Prompt position covered by the restored SSM snapshot and cached KV.
    marconi_skip_to: int = 0
    #: Snapshot slot when the whole prompt matched a snapshot; None otherwise.
    marconi_exact_snap: int | None = None
    #: Session identity; SSM snapshots restore only for a matching tag (0 skips the check).
    session_hash: int = 0
    #: Tenant for the cross-request prompt-lookup cache; None keeps the sequence out of it.
    lookup_tenant: int | None = None
    #: Claim on the shared whole-prompt MTP hidden capture (0: never owned one).
    mtp_capture_gen: int = 0
    #: Ticket for the shared MTP hidden-row interval (0: not drawn).
    mtp_store_gen: int = 0
    #: Prefix-cache namespace of the sequence's LoRA adapter; 0 is the base model.
    adapter_id: int = 0
    #: Paged metadata for chunked prefill, allocated by the first chunk that needs it.
    chunked_prefill_meta: ChunkedPrefillPageMetadata | None = None
    #: Prompt tokens matched by the chunk-0 prefix lookup (drives the ref accounting).
    cached_prefix_tokens: int = 0
    #: Prompt tokens whose KV was read from the prefix cache instead of recomputed; reported
    #: as `usage.prompt_tokens_details.cached_tokens`.
    reused_prefix_tokens: int = 0
    #: Number of `block_table` entries that came from the prefix-cache lookup.
    cached_prefix_blocks: int = 0
    #: The matched prefix tokens, stored at lookup, so a failed prefill can release its refs.
    prefix_ref_tokens: list[int] = field(default_factory=list)
    #: Whether the chunk-0 prefix lookup has run (a retry replays its result).
    prefix_lookup_applied: bool = False
    #: The `skip` result of the chunk-0 lookup, returned again on a replay.
    prefix_lookup_skip: bool = False
    #: Token count of an SSM checkpoint near the prompt's end held for this sequence.
    tail_checkpoint_tokens: int | None = None
    #: Length of the prefix whose paged KV this sequence has written or validly reused.
    kv_valid_tokens: int = 0
    #: Block index of the latest decode-time SSM checkpoint.
    last_decode_ckpt_block: int = 0
    #: Prompt length, set by prefill; the prefix-cache insert takes refs only past it.
    prompt_len: int = 0
    #: High-speed-swap disk block ids, one per logical block the sequence has had.
    disk_block_ids: list[int] = field(default_factory=list)
    #: Per attention layer, how many `disk_block_ids` entries it has offloaded.
    disk_last_offloaded_per_layer: list[int] = field(default_factory=list)
    #: `k` makes prefill score every prompt position with its top-k alternatives.
    collect_prompt_logprobs: int | None = None
    #: One entry per prompt position `i` scoring `tokens[i + 1]`; filled across chunks.
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)
    #: LoRA pool slot this sequence's requests select; -1 selects the active adapter.
    adapter_slot: int = -1
    #: The resolved LoRA pool slot this sequence holds a ref on; -1 when none.
    acquired_adapter_slot: int = -1
    #: NLLB source / target language token ids; 0 uses the deployment default.
    src_lang_id: int = 0
    tgt_lang_id: int = 0
    #: NLLB beam count; 1 turns beam search off.
    num_beams: int = 1
    #: NLLB length penalty: a hypothesis scores `sum_logprob / len**length_penalty`.
    length_penalty: float = 1.0
    #: NLLB: True stops once `num_beams` hypotheses finished.
    early_stopping: bool = False

    @classmethod
    def host_only(cls, slot_idx: int) -> SequenceState:
        """A host-only state: no device resources, no SSM slot, every counter zeroed."""
        return cls(slot_idx=slot_idx)

    def ssm_slot_idx(self) -> int | None:
        """The SSM pool slot this sequence holds, or None; decode batches sort by it."""
        return None if self.ssm_slot is None else self.ssm_slot.idx()

    def hss_window_start(self) -> int:
        """Logical block index of `block_table[0]` (0 without high-speed swap)."""
        return max(0, len(self.disk_block_ids) - len(self.block_table))

    def physical_block_for(self, abs_block_idx: int) -> int | None:
        """Physical block of a logical block index, or None when it has left the window."""
        window_start = self.hss_window_start()
        if abs_block_idx < window_start:
            return None
        rel = abs_block_idx - window_start
        return self.block_table[rel] if rel < len(self.block_table) else None


# --------------------------------------------------------------------------------------------
# The Model protocols
# --------------------------------------------------------------------------------------------


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

    @abstractmethod
    def alloc_sequence(self) -> SequenceState:
        """A new sequence with its layer states (takes an SSM slot on hybrid models)."""

    def alloc_sequence_for(self, budget_tokens: int) -> SequenceState:
        """Same as `alloc_sequence`, sized for `budget_tokens` where that matters."""
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

    def num_total_blocks(self) -> int:
        return 0

    def num_free_slots(self) -> int | None:
        """Free sequence slots of the SSM slot pool; None when the model has no pool (then
        only `max_num_seqs` bounds the running sequences). A metrale extension: admission
        counts slots with it."""
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


class ModelAdapters:
    """LoRA adapters. Default: the base model only."""

    def set_active_lora(self, name: str) -> None:
        raise _unsupported("LoRA adapters")

    def adapter_id_for(self, slot: int) -> int:
        return 0

    def acquire_adapter_slot(self, slot: int) -> int:
        return -1

    def release_adapter_slot(self, resolved: int) -> None:
        return None

    def swap_lora_from_disk(self, path: str, name: str, slot: int) -> None:
        raise _unsupported("LoRA adapters")

    def promote_lora_from_peer(
        self, peer_addr: str, adapter_id: str, name: str, peft: bool
    ) -> tuple[int, str | None]:
        raise _unsupported("LoRA promotion from a peer")

    def promote_lora_from_disk(self, path: str, name: str) -> tuple[int, str | None]:
        raise _unsupported("LoRA promotion from disk")


class ModelSsmState:
    """Recurrent-state checkpoint and rollback. Defaults: a model without SSM layers."""

    def checkpoint_ssm_states(self, seq: SequenceState) -> None:
        if self.has_ssm_layers():
            raise _unsupported("checkpoint_ssm_states")

    def rollback_ssm_states(self, seq: SequenceState, num_accepted: int) -> None:
        if self.has_ssm_layers():
            raise _unsupported("rollback_ssm_states")

    def has_ssm_layers(self) -> bool:
        return False

    def decode_rollback_unsupported(self) -> bool:
        return False

    def decode_rollback_ring_slots(self) -> int:
        return 0

    def save_decode_ssm_snapshot(self, seq: SequenceState, ring_slot: int) -> None:
        raise _unsupported("decode SSM snapshots")

    def restore_decode_ssm_snapshot(self, seq: SequenceState, ring_slot: int) -> None:
        raise _unsupported("decode SSM snapshots")

    def decode_marconi_checkpoint(self, seq: SequenceState) -> None:
        return None

    def start_checkpoint_async(self, seq: SequenceState) -> None:
        self.checkpoint_ssm_states(seq)

    def start_rollback_and_checkpoint_async(self, seq: SequenceState, num_accepted: int) -> None:
        self.rollback_ssm_states(seq, num_accepted)
        self.checkpoint_ssm_states(seq)

    def sync_secondary(self) -> None:
        return None

    def commit_accepted_prefix(self, seq: SequenceState, num_accepted: int, k: int) -> None:
        if self.has_ssm_layers():
            raise _unsupported("commit_accepted_prefix")

    def ssm_snapshot_occupancy(self) -> tuple[int, int] | None:
        return None


class ModelVerify:
    """Speculative verify passes. Input is `[last_verified, draft0, draft1, ...]`."""

    def decode_verify(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        raise _unsupported("decode_verify")

    def decode_verify_graphed(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        return self.decode_verify(tokens, seq, stream)

    def decode_verify_graphed_k3(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        return self.decode_verify(tokens, seq, stream)

    def decode_verify_graphed_k4(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        return self.decode_verify(tokens, seq, stream)

    def can_batch_verify(self, ks: Sequence[int]) -> bool:
        return False

    def decode_verify_batched(
        self,
        tokens: Sequence[int],
        ks: Sequence[int],
        seqs: Sequence[SequenceState],
        stream: Stream = None,
        opts: VerifyBatchedOpts | None = None,
    ) -> list[int]:
        raise _unsupported("decode_verify_batched")

    def decode_verify_graphed_kgamma(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        return self.decode_verify(tokens, seq, stream)

    def decode_verify_dflash(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        return self.decode_verify_graphed_kgamma(tokens, seq, stream)

    def decode_and_verify_fused(
        self, tokens: Sequence[int], seq: SequenceState, stream: Stream = None
    ) -> list[int]:
        raise _unsupported("decode_and_verify_fused")

    def gdn_fold_accepted(
        self, slots: Sequence[int], accepted_rows: Sequence[int], k_rows: Sequence[int]
    ) -> bool:
        return False


class ModelDraft:
    """Draft proposers (MTP, DFlash, self-speculation). Default: no proposer."""

    def mtp_slot_draft_capacity(self, slot_idx: int) -> int:
        return 0

    def generate_speculative(self, prompt: Sequence[int], params: Any, num_drafts: int) -> Any:
        raise _unsupported("generate_speculative")

    def has_proposer(self) -> bool:
        return False

    def dflash_gamma(self) -> int | None:
        return None

    def has_self_speculative(self) -> bool:
        return False

    def decode_draft(self, token: int, seq: SequenceState, stream: Stream = None) -> Tensor:
        raise _unsupported("self-speculative drafting")

    def stash_verify_hidden_rows(self, rows: Sequence[int], stream: Stream = None) -> None:
        raise _unsupported("stash_verify_hidden_rows")

    def stash_verify_catchup_rows(self, slot_rows: Sequence[tuple[int, int]]) -> None:
        raise _unsupported("stash_verify_catchup_rows")

    def run_mtp_catchup_batched(
        self,
        tokens: Sequence[int],
        first_slot: int,
        first_pos: Sequence[int],
        seqs: Sequence[SequenceState],
    ) -> int:
        raise _unsupported("run_mtp_catchup_batched")

    def save_hidden_for_mtp_from_stash(self, idx: int, stream: Stream = None) -> None:
        raise _unsupported("save_hidden_for_mtp_from_stash")

    def run_mtp_propose_batched(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        stash_idx: Sequence[int],
        num_drafts: int,
        seqs: Sequence[SequenceState],
        stream: Stream = None,
        out_conf: list[list[float]] | None = None,
    ) -> list[list[int]] | None:
        return None

    def mtp_propose_batch_max(self) -> int:
        return 1

    def save_hidden_for_mtp(self, token_idx: int, stream: Stream = None) -> None:
        raise _unsupported("MTP drafting")

    def save_hidden_for_catchup(self, token_idx: int, pos: int) -> None:
        raise _unsupported("save_hidden_for_catchup")

    def save_dflash_hidden_for_propose(self, token_idx: int, stream: Stream = None) -> None:
        raise _unsupported("DFlash drafting")

    def dflash_accept_append(self, seq: SequenceState) -> None:
        raise _unsupported("DFlash drafting")

    def dflash_eagle_accept_append(self, seq: SequenceState) -> None:
        raise _unsupported("DFlash drafting")

    def dflash_eagle_kgamma_append(
        self, seq: SequenceState, num_accepted: int, base_pos: int
    ) -> None:
        raise _unsupported("DFlash drafting")

    def dflash_serial_ctx_append(self, seq: SequenceState) -> None:
        raise _unsupported("DFlash drafting")

    def commit_ctx(
        self, seq: SequenceState, num_committed: int, base_pos: int, scratch_row: int
    ) -> None:
        raise _unsupported("DFlash drafting")

    def dflash_capture_band(self) -> int:
        return 0

    def run_mtp_propose(
        self, token: int, position: int, seq: SequenceState, stream: Stream = None
    ) -> int | None:
        raise _unsupported("MTP drafting")

    def run_mtp_propose_multi(
        self,
        token: int,
        position: int,
        num_drafts: int,
        seq: SequenceState,
        stream: Stream = None,
        grammar_bitmask: Any = None,
    ) -> list[int]:
        raise _unsupported("MTP drafting")

    def read_deferred_draft_token(self) -> int | None:
        return None

    def trim_proposer_state(
        self, seq: SequenceState, num_accepted: int, stream: Stream = None
    ) -> None:
        return None


class ModelVision:
    """Image and video embeddings. Default: a text-only model."""

    def prepare_vision_embed(self, items: Sequence[Any]) -> None:
        raise _unsupported("vision input")

    def ep_sync_vision_embeds(self, tokens: Sequence[int]) -> None:
        return None

    def prepare_vision_embed_batched(
        self, items: Sequence[Sequence[Any]]
    ) -> list[tuple[int, int, int, int]]:
        raise _unsupported("vision input")

    def set_vision_slice_base(self, row_base: int, grid_base: int, owned_images: int) -> None:
        return None

    def tokens_contain_vision_pad(self, tokens: Sequence[int]) -> bool:
        return False


class ModelEp:
    """Multi-rank expert-parallel command protocol. Default: a single rank."""

    def ep_worker_step(self, slots: list[SequenceState | None]) -> bool:
        raise _unsupported("expert parallelism")

    def is_ep(self) -> bool:
        return False

    def ep_prefill_batch_rows(self) -> int | None:
        return None

    def ep_broadcast_cmd(self, cmd: int) -> None:
        return None

    def ep_broadcast_cmd_for_seq(self, seq_id: int, cmd: int) -> None:
        return None

    def ep_protocol_v2(self) -> bool:
        return False

    def ep_broadcast_tokens(self, tokens: Sequence[int]) -> list[int]:
        return list(tokens)


class ModelDeviceFeed:
    """Asynchronous device token feed. Default: unsupported."""

    def supports_device_token_feed(self) -> bool:
        return False

    def decode_batch_fed(
        self, sources: Sequence[FeedSource], seqs: Sequence[SequenceState], stream: Stream = None
    ) -> Tensor:
        raise _unsupported("the device token feed")

    def argmax_batch_to_feed(
        self,
        logits: Tensor,
        masks: Sequence[tuple[int, int]],
        dst_pinned: Any,
        event: Any,
        stream: Stream = None,
    ) -> None:
        raise _unsupported("the device token feed")

    def reserve_decode_block(self, seq: SequenceState) -> int:
        raise _unsupported("the device token feed")

    def release_decode_blocks(self, seq: SequenceState, n: int) -> None:
        raise _unsupported("the device token feed")

    def fed_step_settled(self) -> None:
        return None

    def event_query(self, event: Any) -> bool:
        return True

    def event_synchronize(self, event: Any) -> None:
        return None

    def destroy_event(self, event: Any) -> None:
        return None

    def copy_d2h_async(self, src: Tensor, dst: Any, stream: Stream = None) -> None:
        raise _unsupported("the device token feed")

    def alloc_host_pinned(self, nbytes: int) -> Any:
        raise _unsupported("the device token feed")

    def free_host_pinned(self, ptr: Any, nbytes: int) -> None:
        raise _unsupported("the device token feed")


class ModelCircuit:
    """Which forward decode runs. Default: only the hand-written (legacy) forward."""

    def set_forward(self, select: ForwardSelect) -> None:
        if select.kind != "legacy":
            raise Unsupported("no circuit executor: only the legacy forward is available")

    def forward_disclosure(self) -> ForwardDisclosure:
        return ForwardDisclosure()


class Model(
    ModelLifecycle,
    ModelForward,
    ModelLogits,
    ModelAdapters,
    ModelSsmState,
    ModelVerify,
    ModelDraft,
    ModelVision,
    ModelEp,
    ModelDeviceFeed,
    ModelCircuit,
):
    """The whole model-engine interface; one implementation per model family."""
