"""Per-request output state: detokenization, stop strings, logprobs, and the cumulative
`RequestOutput` a client sees.

Owner: engine. One `RequestState` per request, one `ChoiceState` per choice (`n`).

Invariants:
- A choice's `text` is what its detokenizer and stop matcher have released, and its
  `token_ids` are exactly the tokens added to it; both only grow.
- A stop string found in the text ends the choice: the engine finishes its sequence with
  reason "stop" and the string as `stop_reason`; nothing after the string is ever exposed.
- When a choice finishes for any other reason, text held back (a possible stop-string start,
  an incomplete character) is flushed into `text` before the final output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from metrale.engine.request import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from metrale.model_engine.traits import PromptTokenLogprob
from metrale.sampling.params import SamplingParams
from metrale.scheduler.sequence import SchedSequence
from metrale.tokenizer.detokenizer import IncrementalDetokenizer
from metrale.tokenizer.stop import StopStringMatcher
from metrale.tokenizer.tokenizer import Tokenizer


@dataclass
class ChoiceState:
    index: int
    seq: SchedSequence
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher | None
    text: str = ""
    #: The tokens whose text was produced (the scheduler may already hold one more: the
    #: engine commits a step's tokens before it builds their outputs).
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add_text(self, delta: str) -> bool:
        """Append a detokenized delta; returns True when a stop string ended the choice."""
        if self.stops is None:
            self.text += delta
            return False
        emit, stopped = self.stops.process(delta)
        self.text += emit
        return stopped

    def close(self, reason: str, stop_reason: int | str | None) -> None:
        if self.finish_reason is not None:
            return
        if reason != "stop" or not isinstance(stop_reason, str):
            tail = self.detokenizer.finish()
            if self.stops is not None:
                emit, stopped = self.stops.process(tail)
                self.text += emit
                if stopped:
                    reason, stop_reason = "stop", self.stops.stop_reason
                else:
                    self.text += self.stops.flush()
            else:
                self.text += tail
        self.finish_reason = reason
        self.stop_reason = stop_reason


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    choices: list[ChoiceState] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    error: str | None = None
    #: Only the finished output is wanted (no per-step outputs).
    final_only: bool = False

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        seqs: list[SchedSequence],
    ) -> RequestState:
        state = cls(request_id, prompt, prompt_token_ids, params, tokenizer)
        for i, seq in enumerate(seqs):
            stops = (
                StopStringMatcher(params.stop, params.include_stop_str_in_output)
                if params.stop
                else None
            )
            state.choices.append(
                ChoiceState(
                    index=i,
                    seq=seq,
                    detokenizer=IncrementalDetokenizer(
                        tokenizer, prompt_token_ids, params.skip_special_tokens
                    ),
                    stops=stops,
                    logprobs=[] if params.logprobs is not None else None,
                )
            )
        return state

    @property
    def finished(self) -> bool:
        choices = self.choices
        if len(choices) == 1:  # the common case, asked for every request every step
            return choices[0].finish_reason is not None
        return all(c.finish_reason is not None for c in choices)

    def add_token(
        self,
        choice: ChoiceState,
        token: int,
        logprob: float,
        rank: int,
        top: list[tuple[int, float]] | None,
    ) -> bool:
        """Record one sampled token; returns True when a stop string ended the choice."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        choice.token_ids.append(token)
        choice.cumulative_logprob += logprob
        if choice.logprobs is not None:
            entry: PositionLogprobs = {token: Logprob(logprob, rank, self._piece(token))}
            for i, (tid, lp) in enumerate(top or []):
                if tid not in entry:
                    entry[tid] = Logprob(lp, i + 1, self._piece(tid))
            choice.logprobs.append(entry)
        return choice.add_text(choice.detokenizer.add_tokens([token]))

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        if self.params.prompt_logprobs is None:
            return None
        scored = self.choices[0].seq.prompt_logprobs
        if scored is None:
            return None
        return [None, *(self._position(p) for p in scored)]

    def _position(self, p: PromptTokenLogprob) -> PositionLogprobs:
        entry: PositionLogprobs = {p.token_id: Logprob(p.logprob, p.rank, self._piece(p.token_id))}
        for i, (tid, lp) in enumerate(p.top):
            if tid not in entry:
                entry[tid] = Logprob(lp, i + 1, self._piece(tid))
        return entry

    def to_output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in self.choices
        ]
        metrics = {}
        if self.first_token_time is not None:
            metrics["ttft"] = self.first_token_time - self.arrival
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs(),
            num_cached_tokens=self.choices[0].seq.num_cached_tokens,
            metrics=metrics,
            error=self.error,
            embedding=self.choices[0].seq.embedding if self.finished else None,
        )
