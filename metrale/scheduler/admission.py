"""Admission: moving sequences from the swapped and waiting queues into `running`, and giving
each its device state (fresh, swapped in, or a prefix-cache hit).

Owner: scheduler. A mixin of `Scheduler` (`core.py`), which provides the queues, the block
counts and `_chunk`; `Preemption` provides `_requeue_front`. Pure Python: it reaches the model
only through the `Model` interface.

Invariants:
- A sequence not yet `ready` (its output grammar compiling) keeps its place in the queue
  while the sequences behind it are admitted past it.
- The swapped queue is served before the waiting queue, both in queue order (arrival, or
  priority then arrival under `scheduling_policy="priority"`), while fewer than
  `max_num_seqs` run (and, on hybrid models, an SSM slot is free). Admission stops at the
  first sequence that does not fit (no head-of-line bypass); before giving up it reclaims
  prefix-cache blocks, never those of the prefix the sequence itself would reuse.
- A sequence is admitted only when the blocks for all its known tokens plus the one it will
  sample (less what the prefix cache supplies) are available after the running prefills'
  reservations and the decode rows' need, so an admitted prefill finishes without preempting.
- The prefix cache is looked up, reclaimed and filled under a sequence's `prefix_namespace`
  (its adapter id and `cache_namespace`): sequences of different namespaces never share blocks.
- A sequence with a LoRA adapter is admitted only with a ref on the device slot holding it
  (`resolve_adapter_slot` promotes it, evicting the least recently used idle slot). When no
  slot can be had it waits at its place in the queue; adapter sequences behind it wait too
  (the slots drain to it, so it is not starved), base-model sequences behind it are admitted
  past it. `stats.lora_waiting_for_slot` counts the sequences the last pass left waiting.
  A sequence with images is matched and reclaimed by `prefix_tokens()` (its image pads keyed
  by the image hash); its state carries the images (`state.vision`) from `_start` on, so the
  model keys the lookup and the insert the same way.
- `_start` leaves nothing behind on failure: the state it allocated is freed and the sequence
  is WAITING again.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from typing import TYPE_CHECKING

from metrale.errors import KVCacheExhausted
from metrale.model_engine.traits import blocks_for
from metrale.scheduler.parts import SchedulerParts
from metrale.scheduler.plan import StepPlan
from metrale.scheduler.sequence import (  # noqa: F401
    SchedSequence,
    Status,
    prefix_namespace,
    session_hash,
)

logger = logging.getLogger(__name__)


def tenant_key(tenant: str | None) -> int | None:
    """The seed's integer `SequenceState.lookup_tenant` of a tenant name (stable across
    processes: a hash of its bytes, not Python's salted `hash`)."""
    if tenant is None:
        return None
    return int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "little")


class Admission(SchedulerParts):
    """Admit from the swapped and waiting queues (a mixin of `Scheduler`)."""

    if TYPE_CHECKING:  # provided by `Preemption`

        def _requeue_front(self, queue: deque[SchedSequence], seq: SchedSequence) -> None: ...

    def _admission_need(self, seq: SchedSequence) -> tuple[int, int]:
        """(blocks to allocate, tokens the prefix cache would supply) to admit `seq`."""
        if seq.swap is not None:
            return blocks_for(seq.num_known + 1, self.block_size), 0
        matched = 0
        if self.config.enable_prefix_caching and not seq.reads_whole_prompt:
            matched = self.model.prefix_match_len(seq.prefix_tokens(), seq.prefix_namespace)
        need = self._capped(blocks_for(seq.num_known + 1, self.block_size))
        return need - matched // self.block_size, matched

    def _admit(self, plan: StepPlan, budget: int, available: int) -> int:
        deferred: list[tuple[deque[SchedSequence], SchedSequence]] = []
        not_ready: list[tuple[deque[SchedSequence], SchedSequence]] = []
        try:
            return self._admit_queues(plan, budget, available, deferred, not_ready)
        finally:
            # Back at the front of their queues, in their order.
            for queue, seq in reversed(deferred):
                queue.appendleft(seq)
            for queue, seq in not_ready:
                self._requeue_front(queue, seq)
            self.stats.lora_waiting_for_slot = len(deferred)

    def _admit_queues(
        self,
        plan: StepPlan,
        budget: int,
        available: int,
        deferred: list[tuple[deque[SchedSequence], SchedSequence]],
        not_ready: list[tuple[deque[SchedSequence], SchedSequence]],
    ) -> int:
        while (self.swapped or self.waiting) and len(self.running) < self.config.max_num_seqs:
            free_slots = self.model.num_free_slots()
            if free_slots is not None and free_slots <= 0:
                break
            from_swap = bool(self.swapped)
            queue = self.swapped if from_swap else self.waiting
            seq = queue[0]
            if not seq.ready:  # e.g. its grammar is compiling: the queue behind it goes past
                not_ready.append((queue, queue.popleft()))
                continue
            need, _ = self._admission_need(seq)
            if need > available:
                tokens = [] if seq.reads_whole_prompt else seq.prefix_tokens()
                target = need + self._reserved_blocks() + self._decode_need()
                self.model.reclaim_prefix_blocks_for(tokens, seq.prefix_namespace, target)
                available = self._available_blocks() - self._decode_need()
                need, _ = self._admission_need(seq)
                if need > available:
                    break
            if not from_swap and budget <= 0:
                break
            adapter_slot = -1
            if seq.adapter_id:
                # Once one sequence waits for a slot, later adapter sequences wait behind it
                # (so the slots drain to it); base-model sequences go past.
                resolved = None if deferred else self._resolve_adapter(seq, plan)
                if resolved is None:
                    if seq.is_finished:  # `finish` took it out of its queue
                        continue
                    deferred.append((queue, queue.popleft()))
                    continue
                adapter_slot = resolved
            queue.popleft()
            try:
                self._start(seq, adapter_slot)
            except KVCacheExhausted:
                # The pool changed under us (should not happen single-threaded): retry later.
                self._requeue_front(queue, seq)
                break
            self.running.append(seq)
            available = self._available_blocks() - self._decode_need()
            if seq.is_decoding():
                if budget > 0:
                    plan.decode.append(seq)
                    budget -= 1
            elif budget > 0:
                work = self._chunk(seq, budget)
                plan.prefill.append(work)
                budget -= work.length
        return budget

    def _resolve_adapter(self, seq: SchedSequence, plan: StepPlan) -> int | None:
        """The device slot of `seq`'s adapter (promoted if need be), or None when every slot
        is in use. An adapter that cannot be read (gone from disk) ends `seq` with "error"."""
        try:
            return self.model.resolve_adapter_slot(seq.adapter_id)
        except Exception as exc:
            logger.error("sequence %s: its LoRA adapter cannot be served: %s", seq.seq_id, exc)
            self.finish(seq, "error")
            plan.finished.append(seq)
            return None

    def _start(self, seq: SchedSequence, adapter_slot: int = -1) -> None:
        """Give an admitted sequence its device state (fresh, swapped-in, or prefix-hit) and,
        with `adapter_slot` >= 0, a ref on that LoRA slot (released by `free_sequence`)."""
        state = self.model.alloc_sequence()  # blocks come a forward at a time
        state.adapter_id = seq.prefix_namespace
        if adapter_slot >= 0:
            state.adapter_slot = adapter_slot
            state.acquired_adapter_slot = self.model.acquire_adapter_slot(adapter_slot)
        state.prompt_len = seq.prompt_len
        state.lookup_tenant = tenant_key(seq.lookup_tenant)
        state.session_hash = session_hash(
            seq.prefix_namespace, seq.session_id, seq.prompt_token_ids
        )
        state.vision = seq.vision
        seq.state = state
        seq.status = Status.RUNNING
        try:
            if seq.swap is not None:
                record = seq.swap
                record.data.seek(0)
                self.model.restore_sequence_state(state, record.num_blocks, record.data)
                state.tokens = seq.all_tokens[: record.seq_len]
                state.seq_len = record.seq_len
                state.kv_valid_tokens = record.seq_len
                self.stats.swapped_in_blocks += record.num_blocks
                self._drop_swap(seq)
                return
            if seq.reads_whole_prompt:
                if seq.wants_prompt_logprobs:
                    state.collect_prompt_logprobs = seq.params.prompt_logprobs
                if seq.wants_embedding:
                    state.pooling = seq.params.pooling
                return
            if self.config.enable_prefix_caching:
                self.stats.prefix_queries += 1
                reused = self.model.lookup_prefix(state, seq.all_tokens)
                if reused:
                    self.stats.prefix_hit_requests += 1
                    self.stats.prefix_hit_tokens += reused
                if seq.resumed_at is None:
                    seq.num_cached_tokens = reused
        except BaseException:
            seq.state = None
            seq.status = Status.WAITING
            self.model.free_sequence(state)
            raise
