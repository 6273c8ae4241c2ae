"""`StepPlan`: what one engine step runs, as the scheduler decided it.

Owner: scheduler (produced by `Scheduler.schedule`, consumed by the driver and by
`Scheduler.commit`).

Invariants:
- A sequence appears at most once in a plan (as a decode row or as one prefill chunk).
- Decode rows carry one token each, plus their draft tokens (`spec`, by sequence id; only
  rows that have some) when the step speculates; a decode row with drafts computes its last
  token and every draft, and its logits rows score each of them.
  Prefill chunks never exceed the sequence's known tokens.
- `sampled` lists, in row order, the sequences whose row produces a new token this step:
  every decode row, then every prefill chunk that completes its sequence's known tokens.
- A speculating plan (`is_verify`) is never fed: its input tokens are all known.
- A fed plan (`feed_rows` set, from `Scheduler.plan_fed_step`) has decode rows only; decode
  row `i`'s input token is row `feed_rows[i]` of the previous step's sampled tokens, read on
  the device, because that step has not been read back when this one is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.scheduler.sequence import SchedSequence


@dataclass
class PrefillWork:
    seq: SchedSequence
    start: int
    length: int

    @property
    def is_last(self) -> bool:
        return self.start + self.length == self.seq.num_known


@dataclass
class StepPlan:
    decode: list[SchedSequence] = field(default_factory=list)
    prefill: list[PrefillWork] = field(default_factory=list)
    #: Sequences that ended before running (timeouts) or were refused this step.
    finished: list[SchedSequence] = field(default_factory=list)
    #: Fed plans only: per decode row, its row in the previous step's sampled tokens.
    feed_rows: list[int] | None = None
    #: The draft tokens a decode row verifies, by sequence id (rows without drafts are not
    #: in it), so reordering or adding decode rows needs no bookkeeping.
    spec: dict[str, list[int]] = field(default_factory=dict)

    @property
    def drafts(self) -> list[list[int]]:
        """Per decode row, its drafts (empty: none)."""
        return [self.spec.get(seq.seq_id, []) for seq in self.decode]

    @property
    def is_verify(self) -> bool:
        return bool(self.spec)

    @property
    def sampled_drafts(self) -> list[list[int]]:
        """Per `sampled` row, its drafts (prefill rows have none)."""
        return self.drafts + [[] for w in self.prefill if w.is_last]

    @property
    def sampled(self) -> list[SchedSequence]:
        return self.decode + [w.seq for w in self.prefill if w.is_last]

    @property
    def num_tokens(self) -> int:
        drafted = sum(len(d) for d in self.spec.values())
        return len(self.decode) + drafted + sum(w.length for w in self.prefill)

    def is_empty(self) -> bool:
        return not self.decode and not self.prefill
