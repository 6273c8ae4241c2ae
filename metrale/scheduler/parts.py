"""`SchedulerParts`: what `Scheduler`'s mixins (`Admission`, `Preemption`) read of it, declared
once: the queues, the model, the counters, and the block counts and exits `core.py` defines.

Owner: scheduler. Declarations only: nothing here runs, so the mixins' behaviour is exactly
the methods they define.

Invariants:
- Every method here exists only under `TYPE_CHECKING` (a runtime stub would shadow
  `Scheduler`'s own through the MRO); the attributes are annotations that `Scheduler.__init__`
  sets.
- Pure Python: no torch import.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from metrale.model_engine.traits import Model
from metrale.scheduler.sequence import SchedSequence

if TYPE_CHECKING:
    from metrale.scheduler.core import SchedulerConfig, SchedulerStats
    from metrale.scheduler.plan import PrefillWork


class SchedulerParts:
    """The scheduler state and the `core.py` methods its mixins use."""

    model: Model
    config: SchedulerConfig
    stats: SchedulerStats
    block_size: int
    waiting: deque[SchedSequence]
    swapped: deque[SchedSequence]
    running: list[SchedSequence]
    _swap_bytes: int

    if TYPE_CHECKING:

        def finish(
            self, seq: SchedSequence, reason: str, stop_reason: int | str | None = None
        ) -> None: ...

        def _release(self, seq: SchedSequence, offer_to_cache: bool) -> None: ...

        def _drop_swap(self, seq: SchedSequence) -> None: ...

        def _capped(self, blocks: int) -> int: ...

        def _chunk(self, seq: SchedSequence, budget: int) -> PrefillWork: ...

        def _available_blocks(self) -> int: ...

        def _reserved_blocks(self) -> int: ...

        def _decode_need(self, decoding: list[SchedSequence] | None = None) -> int: ...
