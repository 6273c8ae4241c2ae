"""Committing a step's sampled tokens to the scheduler's sequences (a mixin of `Scheduler`):
a verify row's accepted prefix (the rejected drafts rolled back in the model first), each
token appended, and the sequences those tokens end (stop token, EOS, `max_tokens`, the
context) finished.

Owner: scheduler. Invariants:
- The stop rule is `SamplingParams.stop_reason` (stop tokens, EOS unless `ignore_eos`,
  `min_tokens`); the length rule is `_ends_by_length` (the resolved `max_tokens` or the
  context), which planning uses too, so a row is never planned past its end.
- A verify row's rejected suffix is rolled back (`commit_accepted_prefix`) before any of its
  tokens is applied, so a sequence that ends here offers only verified KV to the prefix
  cache; a stop inside an accepted run ends the output there.
- A token a fed step recorded as `FED_TOKEN` is written over at its position before the
  sequence can end.
- Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from metrale.model_engine.traits import FED_TOKEN
from metrale.scheduler.parts import SchedulerParts
from metrale.scheduler.plan import StepPlan
from metrale.scheduler.sequence import SchedSequence


@dataclass
class Committed:
    """One sampled token applied to a sequence."""

    seq: SchedSequence
    token: int
    finished: bool
    #: The token's row in the sampler's output (a `plan.sampled` row, or a verify position).
    row: int
    #: On a verify row's first token: the drafts it verified and how many were accepted.
    drafted: int = 0
    accepted: int = 0


class Commit(SchedulerParts):
    """The commit of a `Scheduler` step (see the module docstring)."""

    def commit(
        self, plan: StepPlan, tokens: Sequence[int], emitted: Sequence[bool] | None = None
    ) -> list[Committed]:
        """Apply a step's sampled tokens; ends finished sequences.

        A plain step has one token per `plan.sampled` row (same order). A verify step
        (`plan.is_verify`) has one token per scored position: sampled row `i` owns
        `1 + len(plan.sampled_drafts[i])` consecutive positions, and `emitted` marks those
        whose token is emitted (a prefix of each row's positions: the accepted drafts, then
        the target's own token). The rejected suffix is rolled back in the model
        (`commit_accepted_prefix`) before any token is applied, so a sequence that ends here
        offers only verified KV to the prefix cache. A stop inside an accepted run ends the
        output there; the rest of the row's tokens are dropped."""
        out: list[Committed] = []
        for work in plan.prefill:
            state = work.seq.state
            if work.is_last and state is not None and state.embedding is not None:
                work.seq.embedding, state.embedding = state.embedding, None
            if (
                work.is_last
                and state is not None
                and state.collect_prompt_logprobs is not None
                and work.seq.prompt_logprobs is None
            ):
                work.seq.prompt_logprobs = list(state.prompt_logprobs)
                state.collect_prompt_logprobs = None
        if not plan.is_verify:
            for row, (seq, token) in enumerate(zip(plan.sampled, tokens, strict=True)):
                if not seq.is_finished:
                    self._apply(seq, int(token), row, out)
            return out
        if emitted is None:
            raise ValueError("a verify step's commit needs the emitted flags of its positions")
        drafts = plan.sampled_drafts
        if len(tokens) != len(emitted) or len(tokens) != sum(1 + len(d) for d in drafts):
            raise ValueError("a verify step's tokens do not match its planned positions")
        position = 0
        for seq, row_drafts in zip(plan.sampled, drafts, strict=True):
            first, k = position, len(row_drafts)
            position += k + 1
            if seq.is_finished:
                continue
            count = 0
            while count <= k and emitted[first + count]:
                count += 1
            count = max(count, 1)  # the target's own token is always emitted
            accepted = count - 1
            if k:
                state = seq.state
                assert state is not None
                self.model.commit_accepted_prefix(state, accepted, k)
                seq.num_draft_tokens += k
                seq.num_accepted_tokens += accepted
            for j in range(count):
                committed = self._apply(seq, int(tokens[first + j]), first + j, out)
                if j == 0 and k:
                    committed.drafted, committed.accepted = k, accepted
                if committed.finished:
                    break
        return out

    def _apply(self, seq: SchedSequence, token: int, row: int, out: list[Committed]) -> Committed:
        """Append one token to `seq` and end it if the token finishes it."""
        seq.output_token_ids.append(token)
        state = seq.state
        if state is not None:
            # A fed step launched after this one recorded the token as FED_TOKEN.
            pos = seq.num_known - 1
            if pos < len(state.tokens) and state.tokens[pos] == FED_TOKEN:
                state.tokens[pos] = token
        reason, stop_reason = self._stop_condition(seq, token)
        if reason is not None:
            self.finish(seq, reason, stop_reason)
        committed = Committed(seq, token, reason is not None, row)
        out.append(committed)
        return committed

    def _stop_condition(self, seq: SchedSequence, token: int) -> tuple[str | None, int | None]:
        n_out = len(seq.output_token_ids)
        reason, stop_token = seq.params.stop_reason(token, n_out, seq.eos_token_ids)
        if reason is None and self._ends_by_length(seq, n_out):
            return "length", None
        return reason, stop_token

    def _ends_by_length(self, seq: SchedSequence, n_out: int) -> bool:
        """Whether `n_out` generated tokens end `seq` by length (its budget or the context)."""
        return n_out >= seq.max_tokens or seq.prompt_len + n_out >= self.config.max_model_len
