"""Committed tokens into request outputs: each choice's text, stop strings, logprobs and
finish, the outputs of a step, and what a failed step or a finished request releases (a
mixin of `Engine`).

Owner: engine. Invariants:
- A token committed for a choice that has since ended (a stop string, an abort) is dropped,
  never shown.
- A row no token could be sampled for ends that choice "error", not the batch; a step that
  raised ends every sequence of its plan "error" with the message, and the engine serves on.
- A request is retired (its choices, matchers and speculation state forgotten) when its
  finished output is returned; a `final_only` request is returned only then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from metrale.engine.output import ChoiceState, RequestState
from metrale.engine.speculation import Speculation
from metrale.sampling.grammar import GrammarState
from metrale.sampling.sampler import SamplerOutput
from metrale.scheduler.core import Committed, Scheduler
from metrale.scheduler.plan import StepPlan
from metrale.scheduler.sequence import SchedSequence

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Pending:
    """Tokens of a step, committed to the scheduler but not yet turned into outputs."""

    out: SamplerOutput
    committed: list[Committed]


class EngineOutputs:
    """Outputs, failures and retirement of an `Engine`'s requests (see the module docstring)."""

    scheduler: Scheduler
    speculation: Speculation
    requests: dict[str, RequestState]
    _choice_of: dict[str, tuple[RequestState, ChoiceState]]
    _grammar_of: dict[str, GrammarState]

    def _outputs(
        self,
        touched: dict[str, RequestState],
        build: Callable[[RequestState], T] = RequestState.to_output,  # type: ignore[assignment]
    ) -> list[T]:
        """`build(state)` of every touched request (a `RequestOutput` by default; the engine
        process builds its wire deltas straight from the state), retiring the finished."""
        outputs = []
        for rid, state in touched.items():
            if state.finished:
                outputs.append(build(state))
                self._retire(rid, state)
            elif not state.final_only:
                outputs.append(build(state))
        return outputs

    def _step_failed(
        self, plan: StepPlan, touched: dict[str, RequestState], exc: Exception
    ) -> None:
        logger.error(
            "step failed; ending its %d sequences",
            len(plan.decode) + len(plan.prefill),
            exc_info=exc,
        )
        self._fail_plan(plan, touched, f"internal error: {type(exc).__name__}: {exc}")

    def _emit(self, pending: _Pending, touched: dict[str, RequestState]) -> None:
        """Turn committed tokens into request state: text, stop strings, logprobs, finishes."""
        out = pending.out
        unsamplable = set(out.unsamplable_rows)
        for c in pending.committed:
            entry = self._choice_of.get(c.seq.seq_id)
            if entry is None:  # aborted since the step ran
                continue
            state, choice = entry
            if choice.finish_reason is not None:
                # Ended (stop string, abort) after this token was already computed: drop it.
                continue
            i = c.row
            touched[state.request_id] = state
            if i in unsamplable:
                # Every token was masked or non-finite: end this choice, not the batch.
                self.scheduler.finish(c.seq, "error")
                state.error = "no token could be sampled (all logits masked or not finite)"
                choice.close("error", None)
                continue
            top = out.top_logprobs[i] if out.top_logprobs is not None else None
            if state.add_token(choice, c.token, out.logprobs[i], out.ranks[i], top):
                assert choice.stops is not None
                self.scheduler.finish(c.seq, "stop", choice.stops.stop_reason)
                choice.close("stop", choice.stops.stop_reason)
            elif c.finished:
                choice.close(c.seq.finish_reason or "stop", c.seq.stop_reason)

    def _fail_plan(self, plan: StepPlan, touched: dict[str, RequestState], message: str) -> None:
        for seq in [*plan.decode, *(w.seq for w in plan.prefill)]:
            self.scheduler.finish(seq, "error")
            entry = self._choice_of.get(seq.seq_id)
            if entry is not None:
                state, choice = entry
                state.error = message
                choice.close("error", None)
                touched[state.request_id] = state

    def _close_choice(self, seq: SchedSequence, touched: dict[str, RequestState]) -> None:
        entry = self._choice_of.get(seq.seq_id)
        if entry is None:
            return
        state, choice = entry
        choice.close(seq.finish_reason or "abort", seq.stop_reason)
        touched[state.request_id] = state

    def _retire(self, request_id: str, state: RequestState) -> None:
        self.requests.pop(request_id, None)
        for choice in state.choices:
            self._choice_of.pop(choice.seq.seq_id, None)
            self._grammar_of.pop(choice.seq.seq_id, None)
            self.speculation.forget(choice.seq)
