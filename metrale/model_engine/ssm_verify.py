"""`SsmVerifyStash`: speculative verify on hybrid (SSM) models, the model-engine half: which
rows of a forward the recurrent layers run token by token, the per-slot stash of each verify
row's checkpoint and recurrence inputs, and the commit that rolls the recurrent state back to
the accepted prefix.

Owner: model-engine. One per hybrid `TransformerModel` (`ssm_stash`), driven by `_mixed`
(`begin` before the forward, `adopt` after it), `VerifyForwards.commit_accepted_prefix`
(`commit`) and the sequence lifecycle (`discard` on free and swap-out, `move` on compact).
The layer half, which runs the rows and takes the checkpoints, is
`metrale.layers.recurrent_verify`.

Invariants:
- In a forward with a verify row (a decode row with drafts), every decode-side row from the
  first verify row on is sequential: recurrent layers run it token by token through the plain
  decode step. The rows before it stay decode rows, prefill chunks stay chunks; attention is
  unchanged.
- At most one stash per SSM slot: the capture of the slot's last verify row (or a bare
  `checkpoint`), from the forward until the sequence's commit; a later verify of the slot
  replaces it, `free_sequence` and swap-out discard it, `compact_sequence` moves it with the
  state. It is never read for another sequence: a commit checks that the stash covers exactly
  the verify being committed (`start + rows == seq_len`, `rows == k + 1`).
- `commit(seq, a, k)`: with every draft accepted the live state is the sequential verify's,
  and the stash is dropped; otherwise every recurrent layer's slot state is restored from the
  checkpoint and rows `0..a` (the last verified token and the accepted drafts) are replayed
  through the same decode step on the stashed inputs, which leaves the state bit for bit as
  the verify left it after those rows: the rejected drafts leave no trace. `num_tokens[slot]`
  becomes the new `seq_len`. A commit that drops drafts without a matching stash raises; it
  never keeps the rejected drafts' state.
- Memory: per verify row and recurrent layer, one conv window and one SSM state (the
  checkpoint) plus `k + 1` rows of pre-conv inputs and dt (Mamba-2) or g and beta (gated
  delta net); freed at the commit.
"""

from __future__ import annotations

from dataclasses import dataclass

from metrale.cache.ssm_pool import SsmSlotPool
from metrale.layers.recurrent_verify import LayerCapture, RecurrentVerify, SlotCapture
from metrale.model_engine.batch import ForwardRow
from metrale.model_engine.traits import SequenceState


@dataclass
class SlotStash:
    """A slot's stash: the tokens its state covered at the checkpoint, and the capture."""

    start: int
    capture: SlotCapture


class SsmVerifyStash:
    def __init__(self, pool: SsmSlotPool) -> None:
        self.pool = pool
        self._by_slot: dict[int, SlotStash] = {}

    def __len__(self) -> int:
        return len(self._by_slot)

    def get(self, slot: int) -> SlotStash | None:
        return self._by_slot.get(slot)

    # ------------------------------------------------------------------ forward

    @staticmethod
    def begin(
        rows: list[ForwardRow], num_single: int, num_decode_rows: int
    ) -> RecurrentVerify | None:
        """Mark the sequential rows of a forward: decode-side rows `num_single ..
        num_decode_rows - 1` (the first has drafts). None when there is no verify row."""
        if num_single >= num_decode_rows:
            return None
        capture = RecurrentVerify()
        for row in rows[num_single:num_decode_rows]:
            row.ssm_verify = capture
        return capture

    def adopt(self, capture: RecurrentVerify) -> None:
        """After the forward (and the sequences' advance): keep each verify row's capture
        under its slot, replacing the slot's previous stash."""
        for slot, slot_capture in capture.captured.items():
            start = self.pool.num_tokens[slot] - slot_capture.rows
            self._by_slot[slot] = SlotStash(start, slot_capture)

    # ------------------------------------------------------------------ checkpoint, rollback

    def checkpoint(self, seq: SequenceState) -> None:
        """A bare checkpoint of the sequence's live state (no verify rows recorded): a
        rollback restores it as taken. A verify forward takes its own checkpoint."""
        slot = _slot(seq)
        layers = [
            LayerCapture(None, (conv, ssm), conv[slot].clone(), ssm[slot].clone(), ())
            for conv, ssm in self.pool.layers
        ]
        self._by_slot[slot] = SlotStash(self.pool.num_tokens[slot], SlotCapture(0, layers))

    def rollback(self, seq: SequenceState, num_accepted: int) -> None:
        """Restore the slot's checkpoint and replay the last verify's rows `0..num_accepted`
        (its last verified token and `num_accepted` drafts); a bare checkpoint is restored as
        taken (`num_accepted` must be 0). Consumes the stash; `num_tokens[slot]` becomes the
        tokens the state now covers. `seq` itself is not changed."""
        slot = _slot(seq)
        stash = self._by_slot.pop(slot, None)
        if stash is None:
            raise ValueError(f"SSM slot {slot} has no checkpoint to roll back to")
        rows = num_accepted + 1 if stash.capture.rows else 0
        if num_accepted < 0 or (not stash.capture.rows and num_accepted):
            raise ValueError(f"cannot keep {num_accepted} drafts of a bare checkpoint")
        stash.capture.replay(slot, rows)
        self.pool.num_tokens[slot] = stash.start + rows

    def commit(self, seq: SequenceState, num_accepted: int, k: int) -> None:
        """The recurrent half of `commit_accepted_prefix` (see the invariants); call it before
        `seq_len` drops the rejected drafts."""
        slot = _slot(seq)
        if num_accepted == k:
            self._by_slot.pop(slot, None)  # the sequential verify's state is the right one
            return
        stash = self._by_slot.get(slot)
        if stash is None or stash.capture.rows != k + 1 or stash.start + k + 1 != seq.seq_len:
            raise ValueError(
                f"SSM slot {slot} holds no checkpoint of this {k}-draft verify: its rejected "
                "drafts cannot be rolled back"
            )
        self.rollback(seq, num_accepted)

    # ------------------------------------------------------------------ lifecycle

    def discard(self, seq: SequenceState) -> None:
        slot = seq.ssm_slot_idx()
        if slot is not None:
            self._by_slot.pop(slot, None)

    def move(self, old: int, new: int) -> None:
        stash = self._by_slot.pop(old, None)
        self._by_slot.pop(new, None)
        if stash is not None:  # captures name pool tensors, not slots: only the key moves
            self._by_slot[new] = stash


def _slot(seq: SequenceState) -> int:
    slot = seq.ssm_slot_idx()
    if slot is None:
        raise ValueError("a sequence of a hybrid model has no SSM slot")
    return slot
