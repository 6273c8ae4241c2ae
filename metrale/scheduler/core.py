"""The scheduling core: queues, admission, chunk planning, mixed batches and preemption.

Owner: scheduler. Pure Python: it reaches the model only through the `Model` interface
(block counts, sequence allocation and release, prefix lookups, swap) and never imports
torch. Each `schedule()` returns a `StepPlan`; `commit()` applies the sampled tokens.
Admission (`admission.py`) and making room by preemption (`preemption.py`) are mixins of
`Scheduler`, each stating its own invariants, as is committing a step's tokens
(`commit.py`); this module plans and speculates.

One rule plans every step: a running sequence's computed tokens catch up with its known tokens
(prompt + output). A sequence one generated token behind is a decode row; anything further
behind (a new prompt, a resumed preempted sequence) gets a prefill chunk. When a chunk
completes the known tokens, its last row samples the next token, so a resumed sequence never
samples a token twice and never loses one. Speculation extends the known tokens of a decode
row by its drafts (`spec_token_ids`) for one step: the row computes its last token and the
drafts, and the commit keeps the accepted prefix (the rest is rolled back in the model).

Invariants:
- Order of service: decode rows first (every decoding sequence every step), then running
  prefills in admission order, then admission from the swapped queue and the waiting queue,
  both FIFO. Admission stops at the first sequence that does not fit (no head-of-line
  bypass); a sequence that could never fit the pool is refused at `add`, so nothing waits
  forever.
- A running sequence's remaining prompt blocks are reserved from admission on, so an admitted
  prefill always finishes without preempting anyone.
- A decode row's drafts fit its `max_tokens` and the context (`draft_room`), cost one token
  of the step budget each, and their blocks count in the row's need (drafts are dropped
  before anyone is preempted for them: `preemption.py`).
- Block counts use `traits.blocks_for` / `traits.blocks_needed`, the formulas the model
  allocates with.
- Every exit path (finish, abort, timeout, error, preemption) releases the sequence's device
  state exactly once, after offering its written KV to the prefix cache.
- A non-final prefill chunk ends on a KV block boundary whenever the budget reaches one; a
  budget smaller than the distance to the next boundary still makes progress. On hybrid
  models with prefix caching a chunk also ends at the model's `prefill_capture_point` (the
  prompt's tail split, its branch point), where the recurrent state is snapshotted.
- `schedule()` runs only when no launched step is unread; `plan_fed_step` plans the next
  decode step while one is (the device token feed) and never admits, prefills, preempts or
  expires anything. `commit` writes each token over the `FED_TOKEN` a fed step recorded at its
  position, before the sequence can end and offer its KV to the prefix cache.
- Hybrid models: admission also needs a free SSM slot (`num_free_slots`), `max_num_seqs` may
  not exceed the slot pool, and decode rows are ordered by SSM slot. A recompute preemption
  frees the slot, so the resumed sequence restarts its recurrent state from zero; a swap
  carries the state with the KV. Verify rows speculate as on any model: the commit's
  `commit_accepted_prefix` also rolls the recurrent state back. `compact_sequence` is never
  called: slots are handed out lowest first and a slot index is only an index into the
  preallocated pool, so fragmented slots cost nothing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from metrale.errors import CapacityError, QueueFullError
from metrale.model_engine.traits import Model, blocks_for, blocks_needed
from metrale.scheduler.admission import Admission, tenant_key
from metrale.scheduler.commit import Commit, Committed
from metrale.scheduler.plan import PrefillWork, StepPlan
from metrale.scheduler.preemption import PREEMPT_IMMUNITY_TOKENS, Preemption
from metrale.scheduler.sequence import SchedSequence, Status

logger = logging.getLogger(__name__)

__all__ = [
    "PREEMPT_IMMUNITY_TOKENS",
    "Committed",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "tenant_key",
]


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    #: Largest prefill chunk one sequence gets per step (None: the token budget).
    max_prefill_chunk: int | None = None
    preemption_mode: str = "recompute"
    #: "fcfs" or "priority" (see `Preemption._queue_key`).
    scheduling_policy: str = "fcfs"
    swap_space_bytes: int = 0
    #: A directory for swap records past `swap_space_bytes` (None: fall back to recompute),
    #: holding at most `swap_spill_bytes`.
    swap_spill_dir: str | None = None
    swap_spill_bytes: int = 0
    enable_prefix_caching: bool = True
    max_queue: int = 4096


@dataclass
class SchedulerStats:
    """Counters the server exports; they only ever grow."""

    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_fallbacks: int = 0
    #: Swap records written to disk because the host swap space was full.
    swap_spills: int = 0
    timeouts: int = 0
    aborts: int = 0
    prefix_queries: int = 0
    prefix_hit_requests: int = 0
    prefix_hit_tokens: int = 0
    #: Sequences the last admission pass left waiting for a LoRA slot (a gauge).
    lora_waiting_for_slot: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class Scheduler(Admission, Preemption, Commit):
    def __init__(
        self, model: Model, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.model = model
        self.config = config
        self.clock = clock
        block_size = model.kv_block_size()
        if block_size is None:
            raise ValueError("the scheduler needs a model with a paged KV cache (kv_block_size)")
        self.block_size: int = block_size
        slots = model.num_total_slots()
        if slots is not None and config.max_num_seqs > slots:
            raise ValueError(
                f"max_num_seqs ({config.max_num_seqs}) exceeds the model's SSM slot pool "
                f"({slots} slots)"
            )
        self.waiting: deque[SchedSequence] = deque()
        self.swapped: deque[SchedSequence] = deque()
        self.running: list[SchedSequence] = []
        self.by_id: dict[str, SchedSequence] = {}
        self.stats = SchedulerStats()
        self._arrivals = 0
        self._swap_bytes = 0
        self._spill_bytes = 0

    # ------------------------------------------------------------------ intake

    def add(self, seq: SchedSequence) -> None:
        """Queue a sequence; refuses one that could never fit, or a full queue."""
        if seq.seq_id in self.by_id:
            raise ValueError(f"sequence id {seq.seq_id!r} is already scheduled")
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the request queue is full ({self.config.max_queue} waiting)")
        peak = min(seq.prompt_len + seq.max_tokens, self.config.max_model_len)
        need = self._capped(blocks_for(peak, self.block_size))
        if need > self.model.num_total_blocks():
            raise CapacityError(
                f"request needs {need} KV blocks for {peak} tokens but the pool "
                f"has {self.model.num_total_blocks()}; it can never be served (lower max_tokens "
                "or the prompt, or enlarge the KV pool)",
                param="max_tokens",
            )
        seq.arrival = self._arrivals
        self._arrivals += 1
        seq.status = Status.WAITING
        self._requeue_front(self.waiting, seq)
        self.by_id[seq.seq_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.swapped) + len(self.running)

    # ------------------------------------------------------------------ exits

    def finish(self, seq: SchedSequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence wherever it is, releasing everything it holds, exactly once."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self._release(seq, offer_to_cache=True)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.SWAPPED:
            self.swapped.remove(seq)
            self._drop_swap(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.by_id.pop(seq.seq_id, None)
        if reason == "abort":
            self.stats.aborts += 1
        elif reason == "timeout":
            self.stats.timeouts += 1

    def abort(self, seq_id: str) -> SchedSequence | None:
        seq = self.by_id.get(seq_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def _release(self, seq: SchedSequence, offer_to_cache: bool) -> None:
        state = seq.state
        if state is None:
            return
        seq.state = None
        try:
            if offer_to_cache and self.config.enable_prefix_caching:
                self.model.cache_sequence(state)
        finally:
            self.model.free_sequence(state)

    def _drop_swap(self, seq: SchedSequence) -> None:
        if seq.swap is not None:
            if seq.swap.on_disk:
                self._spill_bytes -= seq.swap.nbytes
            else:
                self._swap_bytes -= seq.swap.nbytes
            seq.swap.data.close()
            seq.swap = None

    # ---------------------------------------------------------------- planning

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        self._expire(plan)
        budget = self.config.max_num_batched_tokens
        self._trim_drafts()
        self._make_room_for_decode(plan)
        decoding = [seq for seq in self.running if seq.is_decoding()]
        plan.decode = decoding[: max(0, budget)]
        budget -= len(plan.decode)
        budget = self._plan_drafts(plan, budget)
        available = self._available_blocks() - self._decode_need(plan.decode)
        decoding_ids = {id(seq) for seq in decoding}
        for seq in self.running:
            if budget <= 0:
                break
            if id(seq) in decoding_ids:
                continue
            work = self._chunk(seq, budget)
            plan.prefill.append(work)
            budget -= work.length
        budget = self._admit(plan, budget, available)
        # A sequence's drafts are for this plan only. They are cleared after the admissions,
        # whose block counts (`_decode_need`) must still see them: cleared before, an
        # admission could take the blocks of the planned drafts and the verify forward
        # then found the pool exhausted.
        for seq in self.running:
            seq.spec_token_ids = []
        if self.model.num_total_slots() is not None:
            plan.decode.sort(key=_ssm_slot_key)
        return plan

    # ------------------------------------------------------------ speculation

    def draft_room(self, seq: SchedSequence) -> int:
        """Most drafts `seq` may verify next step: every emitted token (the drafts plus the
        target's own) must fit its `max_tokens` and the context."""
        n_out = len(seq.output_token_ids)
        by_tokens = seq.max_tokens - n_out - 1
        by_context = self.config.max_model_len - seq.num_known - 1
        return max(0, min(by_tokens, by_context))

    def _trim_drafts(self) -> None:
        """Drop drafts a row cannot take (not decoding, no room left); cap the rest."""
        for seq in self.running:
            if seq.spec_token_ids:
                room = self.draft_room(seq) if seq.is_decoding() else 0
                del seq.spec_token_ids[room:]

    def _plan_drafts(self, plan: StepPlan, budget: int) -> int:
        """Give each decode row its drafts while the token budget lasts (in row order); the
        rest of a row's drafts, and those of running sequences not decoding this step, are
        dropped, so `spec_token_ids` is exactly the plan's drafts until `schedule` clears them
        after its admissions."""
        planned = {id(seq) for seq in plan.decode}
        for seq in self.running:
            if id(seq) not in planned:
                seq.spec_token_ids = []  # not decoding this step: its drafts cost nothing
        for seq in plan.decode:
            take = max(0, min(len(seq.spec_token_ids), budget))
            if take:
                plan.spec[seq.seq_id] = seq.spec_token_ids[:take]
                budget -= take
            del seq.spec_token_ids[take:]
        return budget

    def plan_fed_step(self, prev: StepPlan) -> StepPlan | None:
        """The decode step after `prev`, planned while `prev`'s tokens are still on the device
        (the device token feed): every sequence `prev` sampled decodes once more, its input
        token read there (`feed_rows`). A sequence `prev` ends by length is left out; one it
        may end by EOS or a stop token is planned, and that row is dropped at commit.

        None when the next step needs what a fed step cannot do (an admission, a prefill
        chunk, a preemption, a timeout) or has no row: the engine then reads `prev` back and
        calls `schedule()`; so is a `prev` that verified drafts (its rows emit a varying
        number of tokens, so no fixed row holds each sequence's next input). Call only with
        `prev` launched and not yet committed."""
        if prev.is_verify:
            return None
        if self.swapped or (self.waiting and len(self.running) < self.config.max_num_seqs):
            return None
        now = self.clock()
        decode: list[SchedSequence] = []
        feed_rows: list[int] = []
        live = 0
        for row, seq in enumerate(prev.sampled):
            if seq.status is not Status.RUNNING:
                if seq.is_finished:  # aborted or stopped since `prev` was planned
                    continue
                return None
            live += 1
            if seq.deadline is not None and now >= seq.deadline:
                return None
            # With the token `prev` is sampling: a sequence that ends by length there is done.
            if self._ends_by_length(seq, len(seq.output_token_ids) + 1):
                continue
            decode.append(seq)
            feed_rows.append(row)
        if live != len(self.running) or not decode:
            return None  # a sequence mid-prefill, or nothing to run
        if self._decode_need(decode) > self.model.num_free_blocks():
            return None  # a preemption may be ahead
        if self.model.num_total_slots() is not None:
            order = sorted(range(len(decode)), key=lambda i: _ssm_slot_key(decode[i]))
            decode = [decode[i] for i in order]
            feed_rows = [feed_rows[i] for i in order]
        return StepPlan(decode=decode, feed_rows=feed_rows)

    def _expire(self, plan: StepPlan) -> None:
        now = self.clock()
        for seq in [*self.running, *self.swapped, *self.waiting]:
            if seq.deadline is not None and now >= seq.deadline:
                self.finish(seq, "timeout")
                plan.finished.append(seq)

    def _capped(self, blocks: int) -> int:
        """`blocks` of one sequence, at most what it ever holds in the device pool at once
        under high-speed swap (its resident blocks plus one prefill chunk's and one more)."""
        limit = self.model.resident_blocks_limit()
        if limit is None:
            return blocks
        chunk = self.config.max_prefill_chunk or self.config.max_num_batched_tokens
        return min(blocks, limit + blocks_for(chunk, self.block_size) + 1)

    def _reserved_blocks(self) -> int:
        """Blocks the running prefills will still allocate to finish their known tokens."""
        total = 0
        swapping = self.model.resident_blocks_limit() is not None
        for seq in self.running:
            state = seq.state
            assert state is not None
            remaining = seq.num_known - state.seq_len
            if remaining > 1 or not seq.output_token_ids:
                # Its known tokens and the one it samples when the chunk completes.
                need = blocks_needed(state, seq.num_known + 1 - state.seq_len, self.block_size)
                if swapping:  # high-speed swap: at most its resident cap, less what it holds
                    held = sum(1 for b in state.block_table if b >= 0)
                    need = min(need, max(self._capped(need + held) - held, 0))
                total += need
        return total

    def _available_blocks(self) -> int:
        return self.model.num_free_blocks() - self._reserved_blocks()

    def _decode_need(self, decoding: list[SchedSequence] | None = None) -> int:
        """Blocks the decode rows (`decoding`, default: found in `running`) still need for
        their last token and their drafts (`spec_token_ids`: after `_plan_drafts`, exactly
        the plan's)."""
        need = 0
        for seq in self.running if decoding is None else decoding:
            if decoding is not None or seq.is_decoding():
                state = seq.state
                assert state is not None
                need += blocks_needed(state, 1 + len(seq.spec_token_ids), self.block_size)
        return need

    def _chunk(self, seq: SchedSequence, budget: int) -> PrefillWork:
        start = seq.num_computed
        remaining = seq.num_known - start
        length = min(remaining, budget)
        if self.config.max_prefill_chunk is not None:
            length = min(length, self.config.max_prefill_chunk)
        if length < remaining:
            aligned_end = (start + length) // self.block_size * self.block_size
            if aligned_end > start:
                length = aligned_end - start
        state = seq.state
        point = self.model.prefill_capture_point(state) if state is not None else None
        if point is not None and start < point < start + length:
            length = point - start  # two-phase prefill: the state is snapshotted there
        return PrefillWork(seq, start, length)


def _ssm_slot_key(seq: SchedSequence) -> int:
    """Decode rows of hybrid models run in SSM slot order (the seed's batch layout)."""
    idx = seq.state.ssm_slot_idx() if seq.state is not None else None
    return -1 if idx is None else idx
