"""The outputs `EngineProcess` sends over its pipe as deltas: `OutputDelta` (what one step
added to one request's output), `DeltaEncoder` (the child's side: a request's state into a
delta against what was sent before) and `Assembly` / `apply_delta` (the parent's side: the
cumulative `RequestOutput` rebuilt).

Owner: engine. Invariants:
- A delta carries only what is new (text, token ids, logprobs), so the bytes sent per step
  grow with the batch, not with the length of the outputs; the prompt's token ids and
  logprobs travel once.
- The child encodes straight from the engine's `RequestState` (`Engine.step_as`): no
  cumulative `RequestOutput` is built there. On the wire a delta is a plain tuple in
  `OutputDelta`'s field order, its choices plain tuples in `ChoiceDelta`'s (plain tuples
  pickle and unpickle several times faster than dataclasses: at 128 streams this path runs
  once per stream per step on both sides of the pipe); `OutputDelta.of` names the fields.
- Rebuilt in order, the deltas of a request give exactly the `RequestOutput`s
  `RequestState.to_output` gives at the same steps.
- `apply_delta` builds a fresh `RequestOutput` (new lists and strings) and never changes the
  previous one, so an output handed to a consumer never changes afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from metrale.engine.handle import RequestStream
from metrale.engine.output import RequestState
from metrale.engine.request import CompletionOutput, PositionLogprobs, RequestOutput


class ChoiceDelta(NamedTuple):
    """What one step added to one choice (on the wire: a plain tuple in this order)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class OutputDelta(NamedTuple):
    """What one step added to one request's `RequestOutput` (on the wire: a plain tuple in
    this order, `choices` a tuple of `ChoiceDelta` tuples)."""

    request_id: str
    finished: bool
    choices: tuple[Any, ...]
    num_cached_tokens: int
    #: Seconds from arrival to the first token, once there is one (`RequestOutput.metrics`).
    ttft: float | None
    error: str | None
    #: Sent once, in the first delta after the prompt was scored.
    prompt_logprobs: list[PositionLogprobs | None] | None
    #: Sent once, in the request's first delta (the engine tokenized a text prompt).
    prompt_token_ids: list[int] | None
    #: An embedding request's vector, in its final delta.
    embedding: list[float] | None

    @classmethod
    def of(cls, wire: tuple[Any, ...]) -> OutputDelta:
        """The named view of a delta read off the pipe."""
        return cls._make(wire)


@dataclass
class _Sent:
    """How much of each choice of one request the parent already has."""

    text: list[int]
    tokens: list[int]
    logprobs: list[int]
    prompt_logprobs: bool = False


class DeltaEncoder:
    """Child side: a request's state into a delta against what was sent before."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode_state(self, state: RequestState) -> tuple[Any, ...]:
        """The wire delta of `state` (`OutputDelta`'s fields, as a plain tuple): what it
        holds beyond what was sent. Mirrors `RequestState.to_output` field by field."""
        rid = state.request_id
        choices_state = state.choices
        sent = self._sent.get(rid)
        first = sent is None
        if sent is None:
            n = len(choices_state)
            sent = self._sent[rid] = _Sent([0] * n, [0] * n, [0] * n)
        choices = []
        for i, c in enumerate(choices_state):
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[sent.logprobs[i] :]
                sent.logprobs[i] = len(c.logprobs)
            text, ids = c.text, c.token_ids
            choices.append(
                (c.index, text[sent.text[i] :], ids[sent.tokens[i] :], logprobs,
                 c.cumulative_logprob, c.finish_reason, c.stop_reason)
            )  # fmt: skip
            sent.text[i], sent.tokens[i] = len(text), len(ids)
        prompt_logprobs = None
        if not sent.prompt_logprobs and state.params.prompt_logprobs is not None:
            prompt_logprobs = state.prompt_logprobs()
            sent.prompt_logprobs = prompt_logprobs is not None
        finished = state.finished
        seq = choices_state[0].seq
        if finished:
            del self._sent[rid]
        ttft = None if state.first_token_time is None else state.first_token_time - state.arrival
        return (
            rid, finished, tuple(choices), seq.num_cached_tokens, ttft, state.error,
            prompt_logprobs, list(state.prompt_token_ids) if first else None,
            seq.embedding if finished else None,
        )  # fmt: skip

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


@dataclass
class Assembly:
    """Parent side: one request's cumulative output so far."""

    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    last: RequestOutput | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None


def apply_delta(assembly: Assembly, delta: OutputDelta) -> RequestOutput:
    """The next cumulative output: fresh lists and strings, the previous one left as it was."""
    before = {c.index: c for c in assembly.last.outputs} if assembly.last else {}
    outputs = []
    for index, text, token_ids, logprobs, cumulative, finish_reason, stop_reason in delta.choices:
        prev = before.get(index)
        if logprobs is not None:
            logprobs = [*(prev.logprobs or [] if prev else []), *logprobs]
        outputs.append(
            CompletionOutput(
                index=index,
                text=(prev.text if prev else "") + text,
                token_ids=[*(prev.token_ids if prev else []), *token_ids],
                cumulative_logprob=cumulative,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
            )
        )
    if delta.prompt_logprobs is not None:
        assembly.prompt_logprobs = delta.prompt_logprobs
    if delta.prompt_token_ids is not None:
        assembly.prompt_token_ids = delta.prompt_token_ids
    output = RequestOutput(
        request_id=delta.request_id,
        prompt=assembly.prompt,
        prompt_token_ids=assembly.prompt_token_ids,
        outputs=outputs,
        finished=delta.finished,
        prompt_logprobs=assembly.prompt_logprobs,
        num_cached_tokens=delta.num_cached_tokens,
        metrics={} if delta.ttft is None else {"ttft": delta.ttft},
        error=delta.error,
        embedding=delta.embedding,
    )
    assembly.last = output
    return output
