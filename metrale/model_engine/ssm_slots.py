"""`SsmSlots`: a hybrid model's recurrent-state slots as the scheduler sees them: whether the
model has recurrent layers, how many slots are free and in all, and the slot compaction the
scheduler asks for (a sequence's state moved into a lower slot, a retired sequence made
slot-less without freeing a slot a survivor now holds).

Owner: model-engine. A mixin of `TransformerModel` (which sets `ssm_pool`, the
`SsmSlotPool`, and `ssm_stash`, the verify stash, when the model is hybrid).

Invariants:
- `compact_sequence` moves every recurrent layer's conv and SSM state bit for bit and frees
  the old slot; the verify stash's entry moves with it.
- `detach_slot_for_reuse` never frees a slot: it only forgets the retired sequence's claim.
"""

from __future__ import annotations

from metrale.cache.ssm_pool import SsmSlotPool
from metrale.model_engine.ssm_verify import SsmVerifyStash
from metrale.model_engine.traits import DETACHED_SLOT, SequenceState


class SsmSlots:
    """Recurrent-state slots of a `TransformerModel` (see the module docstring)."""

    ssm_pool: SsmSlotPool | None
    ssm_stash: SsmVerifyStash | None

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
        old_slot = seq.ssm_slot_idx()
        self.ssm_pool.move(seq.ssm_slot, new_slot)  # type: ignore[arg-type]
        seq.slot_idx = new_slot
        if self.ssm_stash is not None and old_slot is not None:
            self.ssm_stash.move(old_slot, new_slot)

    def detach_slot_for_reuse(self, seq: SequenceState) -> None:
        """Make a retired sequence slot-less without freeing its slot: a survivor has been (or
        is about to be) compacted into it, so releasing it would free a live slot."""
        if seq.ssm_slot is not None:
            seq.ssm_slot.forget()  # type: ignore[attr-defined]
            seq.ssm_slot = None
        seq.slot_idx = DETACHED_SLOT
