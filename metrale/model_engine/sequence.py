"""The seed's per-sequence state and pass I/O types: `SequenceState`, `PrefillSlice`,
`MixedForwardResult`, `MixedBatchResult`, `ChunkedPrefillPageMetadata`, `PromptTokenLogprob`,
`BeamReq`, `VerifyBatchedOpts`, `PrefixReclaim` and the decode batch ladder, mirroring
`spec/traits.rs`; and `blocks_needed`, the one count of the KV blocks a sequence must add. `metrale.model_engine.traits` re-exports all of them.

Owner: model-engine.

Invariants:
- Importing this module never imports torch: the scheduler core is pure Python.
- Field names and meanings are the seed's; `DevicePtr` becomes a torch tensor (None for NULL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from metrale.cache.block_pool import blocks_for

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
    #: True, False or "never" (transformers' meanings; `metrale.model_engine.beam`).
    early_stopping: bool | str = False


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
    """Input id of a fed decode row: the previous step's on-device sampled token of
    `from_row`, or a host token."""

    from_row: int | None = None
    host_token: int | None = None


#: What `SequenceState.tokens` holds at a fed row's position until the step that sampled the
#: token commits and writes the real id there (token ids are never negative, so a prefix
#: cache can never match it).
FED_TOKEN = -1


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
    #: Snapshot slot when the whole prompt matched a snapshot; None otherwise (metrale never
    #: restores an exact-end snapshot: the last token's logits need the state before it).
    marconi_exact_snap: int | None = None
    #: Session identity: the SSM snapshot store keeps the snapshots of recently active
    #: sessions (snapshots are content-addressed, so any session may restore them; 0: none).
    session_hash: int = 0
    #: Tenant for the cross-request prompt-lookup cache; None keeps the sequence out of it.
    lookup_tenant: int | None = None
    #: Claim on the shared whole-prompt MTP hidden capture (0: never owned one).
    mtp_capture_gen: int = 0
    #: Ticket for the shared MTP hidden-row interval (0: not drawn).
    mtp_store_gen: int = 0
    #: Prefix-cache namespace: the LoRA adapter's id (0: the base model), or a hash of it and
    #: the request's cache namespace (`scheduler.sequence.prefix_namespace`).
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
    #: Hybrid prefix caching: the prompt's tail split, where two-phase prefill snapshots the
    #: recurrent state (None: no tail capture planned).
    tail_checkpoint_tokens: int | None = None
    #: Length of the prefix whose paged KV this sequence has written or validly reused.
    kv_valid_tokens: int = 0
    #: Block index of the latest decode-time SSM checkpoint.
    last_decode_ckpt_block: int = 0
    #: Hybrid prefix caching: the KV match point past the deepest snapshot, where prefill
    #: snapshots the state too (Marconi's branch point); None when there is none.
    ssm_branch_tokens: int | None = None
    #: Hybrid prefix caching: the private decode-track snapshot (`ssm_snapshots.Snapshot`)
    #: published when the sequence is cached, released when it is freed otherwise.
    ssm_track: Any = None
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
    #: "mean" / "last": prefill pools the prompt's final hidden states (an embedding).
    pooling: str | None = None
    #: The running sum (mean) or the last row (last) of those hidden states, float32.
    pooled: Any = None
    #: Prompt positions summed into `pooled`.
    pooled_count: int = 0
    #: The finished embedding (L2-normalised), set by the last prefill chunk.
    embedding: list[float] | None = None
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
    #: NLLB: True stops once `num_beams` hypotheses finished ("never": transformers' meaning).
    early_stopping: bool | str = False
    #: The prompt's images (`metrale.model_engine.vision.VisionInputs`); None for text.
    vision: Any = None

    @classmethod
    def host_only(cls, slot_idx: int) -> SequenceState:
        """A host-only state: no device resources, no SSM slot, every counter zeroed."""
        return cls(slot_idx=slot_idx)

    def adopt_cached_prefix(
        self, tokens: Sequence[int], reused: int, matched: int, num_blocks: int
    ) -> None:
        """Record a prefix-cache hit: the first `reused` tokens' KV is read from the cache
        (`num_blocks` blocks of `block_table` came from it, matching `matched` tokens, whose
        refs a failed prefill releases), and the chunk-0 lookup replays as a skip."""
        self.tokens = list(tokens[:reused])
        self.seq_len = self.kv_valid_tokens = reused
        self.cached_prefix_tokens = matched
        self.cached_prefix_blocks = num_blocks
        self.prefix_ref_tokens = list(tokens[:matched])
        self.reused_prefix_tokens = reused
        self.prefix_lookup_skip = True

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


def blocks_needed(seq: SequenceState, new_tokens: int, block_size: int) -> int:
    """How many blocks `seq` must add to its `block_table` to hold `new_tokens` more tokens.

    The one answer to that question: `TransformerModel` allocates exactly this many before a
    forward, and the scheduler counts with it when it reserves blocks and plans decode rows."""
    return max(0, blocks_for(seq.seq_len + new_tokens, block_size) - len(seq.block_table))
