"""The optional `Model` capabilities: adapters, SSM state, verify, drafting, vision, expert
parallelism, the device token feed and the circuit selector (the seed's `ModelAdapters`,
`ModelSsmState`, `ModelVerify`, `ModelDraft`, `ModelVision`, `ModelEp`, `ModelDeviceFeed`,
`ModelCircuit`).

Owner: model-engine. Re-exported by `metrale.model_engine.traits`.

Invariants:
- A capability a model lacks keeps the seed's default: a neutral value, or an `Unsupported`
  error that names the method; never a silent no-op that loses work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metrale.errors import Unsupported
from metrale.model_engine.protocols import _unsupported
from metrale.model_engine.sequence import (
    FeedSource,
    ForwardDisclosure,
    ForwardSelect,
    MixedBatchResult,
    PrefillSlice,
    SequenceState,
    Stream,
    Tensor,
    VerifyBatchedOpts,
)


class ModelAdapters:
    """LoRA adapters. Default: the base model only."""

    def set_active_lora(self, name: str) -> None:
        raise _unsupported("LoRA adapters")

    def adapter_id_for(self, slot: int) -> int:
        return 0

    def resolve_adapter_slot(self, adapter_id: int) -> int | None:
        """The device slot holding adapter `adapter_id` (promoting it if needed), -1 for the
        base model (id 0), None when every slot is in use (the caller waits). Not in the
        seed: its scheduler resolved slots through `promote_lora_from_disk`."""
        if adapter_id == 0:
            return -1
        raise _unsupported("LoRA adapters")

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

    # Not in the seed: the engine's registry of adapters (names, ids, load and unload).
    def load_lora(self, name: str, path: str, adapter_id: int | None = None) -> int:
        """Read, check and register the adapter at `path` as `name` (under `adapter_id` when
        given and free); returns its id."""
        raise _unsupported("LoRA adapters")

    def unload_lora(self, name: str) -> int:
        """Forget adapter `name` (refused while a sequence holds its slot); returns its id."""
        raise _unsupported("LoRA adapters")

    def lora_adapters(self) -> list[Any]:
        """The registered adapters (`name`, `adapter_id`, `path` each)."""
        return []

    def lora_stats(self) -> dict[str, int]:
        """The slot pool's gauges and counters; empty without LoRA."""
        return {}


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

    def prefill_capture_point(self, seq: SequenceState) -> int | None:
        """A metrale extension: the next position past `seq.seq_len` where the scheduler must
        end a prefill chunk so the model can snapshot its recurrent state (None: none)."""
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

    def mixed_verify_batch(
        self,
        decode_tokens: Sequence[int],
        drafts: Sequence[Sequence[int]],
        decode_seqs: Sequence[SequenceState],
        prefill_streams: Sequence[PrefillSlice],
        stream: Stream = None,
    ) -> MixedBatchResult:
        """`mixed_forward_batch` whose decode row `i` also feeds its drafts `drafts[i]`
        (a metrale extension: the engine's verify step, prefill chunks beside it). Row `i`
        advances by `1 + len(drafts[i])` tokens; `decode_logits` holds `1 + len(drafts[i])`
        rows for it, in row order, each scoring the token after its input token. The caller
        rolls back the rejected drafts with `commit_accepted_prefix`."""
        raise _unsupported("mixed_verify_batch")


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
