"""The outputs `EngineProcess` sends over its pipe as deltas: `OutputDelta` (what one step
added to one request's output), `DeltaEncoder` (the child's side: cumulative outputs into
deltas against what was sent before) and `Assembly` / `apply_delta` (the parent's side: the
cumulative `RequestOutput` rebuilt).

Owner: engine. Invariants:
- A delta carries only what is new (text, token ids, logprobs), so the bytes sent per step
  grow with the batch, not with the length of the outputs; the prompt's token ids and
  logprobs travel once.
- `apply_delta` builds a fresh `RequestOutput` (new lists and strings) and never changes the
  previous one, so an output handed to a consumer never changes afterwards; applying every
  delta of a request in order gives the outputs the engine produced.
"""

from __future__ import annotations

from dataclasses import dataclass

from metrale.engine.handle import RequestStream
from metrale.engine.request import CompletionOutput, PositionLogprobs, RequestOutput


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class OutputDelta:
    """What one step added to one request's `RequestOutput`."""

    request_id: str
    finished: bool
    choices: list[ChoiceDelta]
    num_cached_tokens: int
    metrics: dict[str, float]
    error: str | None
    #: Sent once, in the first delta after the prompt was scored.
    prompt_logprobs: list[PositionLogprobs | None] | None
    #: Sent once, in the request's first delta (the engine tokenized a text prompt).
    prompt_token_ids: list[int] | None
    #: An embedding request's vector, in its final delta.
    embedding: list[float] | None = None


@dataclass
class _Sent:
    """How much of each choice of one request the parent already has."""

    text: list[int]
    tokens: list[int]
    logprobs: list[int]
    prompt_logprobs: bool = False


class DeltaEncoder:
    """Child side: turns cumulative outputs into deltas against what was sent before."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, output: RequestOutput) -> OutputDelta:
        n = len(output.outputs)
        sent = self._sent.get(output.request_id)
        first = sent is None
        if sent is None:
            sent = self._sent[output.request_id] = _Sent([0] * n, [0] * n, [0] * n)
        choices = []
        for i, c in enumerate(output.outputs):
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[sent.logprobs[i] :]
                sent.logprobs[i] = len(c.logprobs)
            choices.append(
                ChoiceDelta(
                    c.index,
                    c.text[sent.text[i] :],
                    c.token_ids[sent.tokens[i] :],
                    logprobs,
                    c.cumulative_logprob,
                    c.finish_reason,
                    c.stop_reason,
                )
            )
            sent.text[i], sent.tokens[i] = len(c.text), len(c.token_ids)
        prompt_logprobs = None
        if output.prompt_logprobs is not None and not sent.prompt_logprobs:
            prompt_logprobs, sent.prompt_logprobs = output.prompt_logprobs, True
        if output.finished:
            del self._sent[output.request_id]
        return OutputDelta(
            output.request_id, output.finished, choices, output.num_cached_tokens,
            dict(output.metrics), output.error, prompt_logprobs,
            list(output.prompt_token_ids) if first else None,
            output.embedding if output.finished else None,
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
    for d in delta.choices:
        prev = before.get(d.index)
        logprobs = None
        if d.logprobs is not None:
            logprobs = [*(prev.logprobs or [] if prev else []), *d.logprobs]
        outputs.append(
            CompletionOutput(
                index=d.index,
                text=(prev.text if prev else "") + d.text,
                token_ids=[*(prev.token_ids if prev else []), *d.token_ids],
                cumulative_logprob=d.cumulative_logprob,
                logprobs=logprobs,
                finish_reason=d.finish_reason,
                stop_reason=d.stop_reason,
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
        metrics=delta.metrics,
        error=delta.error,
        embedding=delta.embedding,
    )
    assembly.last = output
    return output
