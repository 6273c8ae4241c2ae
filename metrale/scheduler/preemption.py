"""Making room for the decode rows: prefix-cache reclaim, dropping drafts, then preemption
by recompute or by swap.

Owner: scheduler. A mixin of `Scheduler` (`core.py`), which provides the queues, the block
counts (`_decode_need`, `_available_blocks`) and the exits (`finish`, `_release`). Pure Python:
it reaches the model only through the `Model` interface.

Invariants:
- When decode rows need more blocks than are free, prefix-cache blocks are reclaimed first,
  then every draft is dropped, then victims are preempted (the cache blocks a recompute
  victim leaves are reclaimed before the next victim is chosen): fewest generated tokens, latest
  arrival on ties (under the "priority" policy: the lowest priority, latest arrival); sequences resumed within `PREEMPT_IMMUNITY_TOKENS` generated tokens are
  immune unless all are. A lone sequence that still does not fit ends with "error".
- A recompute preemption offers the sequence's written KV to the prefix cache and releases it
  exactly once; a swap saves it to host memory (within `swap_space_bytes`, else it falls back
  to a file in `swap_spill_dir` within `swap_spill_bytes`, counted in `swap_spills`, else to
  recompute, counted) and releases it without caching. Either way the sequence goes back
  to its queue in queue order (`_queue_key`: arrival, or priority then arrival), so older
  preempted sequences resume first.
- A sequence that wants prompt logprobs is never swapped (its scores are recomputed).
"""

from __future__ import annotations

import io
import logging
import tempfile
from collections import deque
from typing import IO, cast

from metrale.scheduler.parts import SchedulerParts
from metrale.scheduler.plan import StepPlan
from metrale.scheduler.sequence import SchedSequence, Status, SwapRecord

logger = logging.getLogger(__name__)

PREEMPT_IMMUNITY_TOKENS = 64


class Preemption(SchedulerParts):
    """Reclaim, drop drafts, preempt (a mixin of `Scheduler`)."""

    def _make_room_for_decode(self, plan: StepPlan) -> None:
        need = self._decode_need()
        if need <= self._available_blocks():
            return
        self.model.reclaim_prefix_blocks(need - self._available_blocks())
        if self._decode_need() > self._available_blocks():
            # Drafts are optional: give up speculating before preempting anyone for it.
            for seq in self.running:
                seq.spec_token_ids = []
        while self._decode_need() > self._available_blocks():
            # A recompute victim's blocks went to the prefix cache: reclaim them first.
            short = self._decode_need() - self._available_blocks()
            if self.model.reclaim_prefix_blocks(short) > 0:
                continue
            if len(self.running) <= 1:
                # A lone sequence always fits (`add` checks its peak); a shortfall here means
                # blocks leaked. End it with an error rather than stall the engine; the plan
                # reports it, so its request gets its final output.
                for seq in list(self.running):
                    logger.error("KV pool cannot hold the only running sequence %s", seq.seq_id)
                    self.finish(seq, "error")
                    plan.finished.append(seq)
                return
            self._preempt(self._choose_victim())

    def _choose_victim(self) -> SchedSequence:
        def immune(s: SchedSequence) -> bool:
            return (
                s.resumed_at is not None
                and len(s.output_token_ids) - s.resumed_at < PREEMPT_IMMUNITY_TOKENS
            )

        candidates = [s for s in self.running if not immune(s)] or list(self.running)
        if self.config.scheduling_policy == "priority":  # the lowest priority, latest arrival
            return max(candidates, key=lambda s: (s.priority, s.arrival))
        return min(candidates, key=lambda s: (len(s.output_token_ids), -s.arrival))

    def _preempt(self, seq: SchedSequence) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        state = seq.state
        assert state is not None
        if self.config.preemption_mode == "swap" and self._try_swap_out(seq):
            return
        if seq.wants_prompt_logprobs:
            state.prompt_logprobs.clear()
        self._release(seq, offer_to_cache=True)
        seq.status = Status.WAITING
        seq.resumed_at = len(seq.output_token_ids)
        self._requeue_front(self.waiting, seq)
        self.stats.preemptions_recompute += 1
        logger.debug("preempted %s for recompute at %d tokens", seq.seq_id, seq.num_known)

    def _try_swap_out(self, seq: SchedSequence) -> bool:
        state = seq.state
        assert state is not None
        if seq.reads_whole_prompt:
            return False
        buffer: IO[bytes] = io.BytesIO()
        self.model.save_sequence_state(state, buffer)
        nbytes = buffer.tell()
        on_disk = False
        if self._swap_bytes + nbytes > self.config.swap_space_bytes:
            spill = self.config.swap_spill_dir
            if spill is None or self._spill_bytes + nbytes > self.config.swap_spill_bytes:
                self.stats.swap_fallbacks += 1
                logger.warning(
                    "swap space full (%d of %d bytes%s); preempting %s for recompute instead",
                    self._swap_bytes, self.config.swap_space_bytes,
                    f", disk {self._spill_bytes} of {self.config.swap_spill_bytes}" if spill else "",
                    seq.seq_id,
                )  # fmt: skip
                return False
            # Past the host swap space: the record goes to a file (deleted when closed).
            disk = tempfile.TemporaryFile(dir=spill, prefix="metrale-swap-")  # noqa: SIM115
            disk.write(cast(io.BytesIO, buffer).getbuffer())
            buffer, on_disk = disk, True
            self._spill_bytes += nbytes
            self.stats.swap_spills += 1
        buffer.seek(0)
        seq.swap = SwapRecord(buffer, len(state.block_table), state.seq_len, nbytes, on_disk)
        if not on_disk:
            self._swap_bytes += nbytes
        self.stats.swapped_out_blocks += len(state.block_table)
        self.stats.preemptions_swap += 1
        self._release(seq, offer_to_cache=False)
        seq.status = Status.SWAPPED
        seq.resumed_at = len(seq.output_token_ids)
        self._requeue_front(self.swapped, seq)
        return True

    def _queue_key(self, seq: SchedSequence) -> tuple[int, int]:
        """A queue's order: arrival, or (priority, arrival) under the "priority" policy."""
        if self.config.scheduling_policy == "priority":
            return seq.priority, seq.arrival
        return 0, seq.arrival

    def _requeue_front(self, queue: deque[SchedSequence], seq: SchedSequence) -> None:
        """Insert in queue order (`_queue_key`), so older preempted sequences resume first
        (and, under the "priority" policy, higher priorities before them)."""
        key = self._queue_key(seq)
        if not queue or self._queue_key(queue[-1]) <= key:
            queue.append(seq)
            return
        for i, other in enumerate(queue):
            if self._queue_key(other) > key:
                queue.insert(i, seq)
                return
        queue.append(seq)
