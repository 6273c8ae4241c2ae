"""The device side of an engine step: the forward of a plan (fed from the step in flight, or
from the known tokens), its sampler (sample or verify) queued with the copy of the sampled
tokens to the host, and the commit of those tokens to the scheduler (a mixin of `Engine`).

Owner: engine. Invariants:
- `_forward_step` and `_sample_step` queue work on the device and never wait for it; only
  `_commit` reads the sampled tokens back.
- A fed plan's rows count the token they are fed (`_Forward.pending` = 1), so seeded draws,
  min_tokens and penalties see every token of the synchronous schedule.
- `_commit` hands the tokens to the scheduler (which ends sequences at EOS, stop tokens or
  their length) and advances each constrained row's matcher; text and outputs are built
  later by `EngineOutputs._emit`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from metrale.engine.engine_outputs import _Pending
from metrale.model_engine.traits import FeedSource, Model, PrefillSlice
from metrale.sampling.grammar import GrammarState
from metrale.sampling.sampler import SampledBatch, Sampler, SamplingRow
from metrale.scheduler.core import Committed, Scheduler
from metrale.scheduler.plan import StepPlan

if TYPE_CHECKING:
    from metrale.engine.engine import _InFlight


@dataclass
class _Forward:
    """A launched forward whose logits are not sampled yet."""

    logits: torch.Tensor | None
    #: Tokens of each row sampled but not in its output yet (see `Engine._sample_step`).
    pending: int
    pending_tokens: torch.Tensor | None


class EngineForward:
    """Forward, sample and commit of an `Engine` step (see the module docstring)."""

    model: Model
    sampler: Sampler
    scheduler: Scheduler
    _grammar_of: dict[str, GrammarState]

    #: `EngineGrammar._advance_grammars`: constrained rows' matchers follow their commit.
    _advance_grammars: Callable[[list[Committed]], list[Committed]]

    def _forward_step(self, plan: StepPlan, previous: _InFlight | None) -> _Forward:
        """The forward of `plan`, queued on the device (no host sync). A fed plan reads its
        input tokens from `previous`, the step launched before it and not yet read back."""
        if plan.feed_rows is None:
            return _Forward(self._forward(plan), 0, None)
        assert previous is not None
        feed = previous.batch.token_ids
        logits = self.model.decode_batch_fed(
            [FeedSource(from_row=r) for r in plan.feed_rows],
            [s.state for s in plan.decode],  # type: ignore[misc]
            feed=feed,
        )
        pending_tokens = None
        if any(s.params.uses_penalties for s in plan.decode):  # they count that token
            index = torch.tensor(plan.feed_rows, dtype=torch.int64)
            pending_tokens = feed.index_select(0, index.to(feed.device, non_blocking=True))
        return _Forward(logits, 1, pending_tokens)

    def _sample_step(self, plan: StepPlan, forward: _Forward) -> SampledBatch | None:
        """The sampler of `plan` over `forward`'s logits, queued with the copy of the sampled
        tokens to the host. `forward.pending`: tokens of each row sampled but not yet in its
        output (1 for a fed step sampled before the step it feeds from is read back)."""
        sampled = plan.sampled
        if not sampled:
            return None
        assert forward.logits is not None
        rows = [
            SamplingRow(
                params=s.params,
                output_token_ids=s.output_token_ids,
                prompt_token_ids=s.prompt_token_ids,
                seed=s.seed,
                eos_token_ids=s.eos_token_ids,
                pending=forward.pending,
                grammar=self._grammar_of.get(s.seq_id),
            )
            for s in sampled
        ]
        if plan.is_verify:
            batch = self.sampler.verify(forward.logits, rows, plan.sampled_drafts)
        else:
            batch = self.sampler.sample(forward.logits, rows, forward.pending_tokens)
        batch.start_copy()
        return batch

    def _forward(self, plan: StepPlan) -> torch.Tensor | None:
        decode_tokens = [s.output_token_ids[-1] for s in plan.decode]
        decode_states = [s.state for s in plan.decode]
        slices = [
            PrefillSlice(w.seq.all_tokens, w.seq.state, w.start, w.length, w.is_last)  # type: ignore[arg-type]
            for w in plan.prefill
        ]
        if plan.is_verify:
            result = self.model.mixed_verify_batch(
                decode_tokens,
                plan.drafts,
                decode_states,
                slices,  # type: ignore[arg-type]
            )
        else:
            result = self.model.mixed_forward_batch(decode_tokens, decode_states, slices)  # type: ignore[arg-type]
        blocks = [] if result.decode_logits is None else [result.decode_logits]
        blocks += [p for p in result.prefill_logits if p is not None]
        if len(blocks) == 1:  # a decode-only step: no copy of [rows, vocab] logits
            return blocks[0]
        return torch.cat(blocks) if blocks else None

    def _commit(
        self, plan: StepPlan, batch: SampledBatch, advance_grammars: bool = True
    ) -> _Pending:
        """Wait for the sampled tokens and hand them to the scheduler (which ends sequences
        at EOS, stop tokens or their length); their outputs are built by `_emit`.
        `advance_grammars=False`: the caller advances the constrained rows' matchers itself
        (`Engine.step`'s late-sampled path does, on the grammar worker thread)."""
        out = batch.to_host()
        committed = self.scheduler.commit(plan, out.token_ids, out.emitted)
        if self._grammar_of and advance_grammars:
            committed = self._advance_grammars(committed)
        return _Pending(out, committed)
