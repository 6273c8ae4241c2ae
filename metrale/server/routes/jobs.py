"""What the OpenAI generation routes share: `Job` (one HTTP request's engine streams, the
outputs so far, usage, and its close) and the SSE body of a streamed answer (`event_stream`);
the answer itself is `Generation.stream` / `Generation.wait`'s (`routes/common.py`).

Owner: server. Invariants:
- A job closes once however it ends (finished, error, disconnect): what still runs is
  aborted and the request is accounted in the metrics with each choice's finish reason.
- A stream that fails after its first byte ends with an OpenAI error frame, then `[DONE]`.
- An engine output with an error ends the request (`InternalServerError`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from metrale.engine.async_engine import RequestStream
from metrale.engine.request import CompletionOutput, RequestOutput
from metrale.errors import MetraleError
from metrale.server.errors import InternalServerError, error_body
from metrale.server.metrics import RequestTracker
from metrale.server.protocol.openai_output import usage
from metrale.server.state import ServerState
from metrale.server.streaming import merge_streams, sse

SYSTEM_FINGERPRINT = "fp_metrale"


@dataclass
class Job:
    """One HTTP generation request: its engine streams and what has been produced so far."""

    state: ServerState
    request_id: str
    streams: list[RequestStream]
    prompts: Sequence[tuple[str | None, list[int]]]
    n: int
    tracker: RequestTracker
    created: int = field(default_factory=lambda: int(time.time()))
    finals: list[RequestOutput | None] = field(default_factory=list)
    #: The `model` the answer names: the served model, or the LoRA adapter asked for.
    model: str = ""

    def __post_init__(self) -> None:
        self.finals = [None] * len(self.streams)

    def record(self, index: int, output: RequestOutput) -> None:
        self.finals[index] = output
        self.tracker.on_tokens(self.completion_tokens())
        if output.error is not None:
            raise InternalServerError(f"generation failed: {output.error}")

    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.finals if o is not None for c in o.outputs)

    def all_finished(self) -> bool:
        return all(o is not None and o.finished for o in self.finals)

    def usage(self, count_completion: bool = True) -> dict[str, Any]:
        return usage(
            sum(len(ids) for _, ids in self.prompts),
            self.completion_tokens() if count_completion else 0,
            sum(o.num_cached_tokens for o in self.finals if o is not None),
        )

    async def run_to_end(self) -> None:
        merged = merge_streams(self.streams)
        try:
            async for index, output in merged:
                self.record(index, output)
        finally:
            await merged.aclose()

    def close(self) -> None:
        """Abort what is still running and account the request in the metrics (idempotent)."""
        for stream in self.streams:
            stream.abort()
        reasons = []
        for output in self.finals:
            choices = output.outputs if output is not None else []
            reasons += [c.finish_reason or "abort" for c in choices]
            reasons += ["abort"] * (self.n - len(choices))
        self.tracker.finish(
            sum(len(ids) for _, ids in self.prompts),
            sum(o.num_cached_tokens for o in self.finals if o is not None),
            self.completion_tokens(),
            reasons,
        )

    def choices(self) -> list[tuple[int, int, RequestOutput, CompletionOutput]]:
        """(choice index, prompt index, request output, choice) of every finished choice."""
        result = []
        for p, output in enumerate(self.finals):
            assert output is not None
            for choice in output.outputs:
                result.append((p * self.n + choice.index, p, output, choice))
        return result


async def error_frames(exc: BaseException) -> AsyncIterator[str]:
    yield sse(error_body(exc))
    yield sse("[DONE]")


Outputs = AsyncIterator[tuple[int, RequestOutput]]


async def event_stream(
    job: Job,
    frames: Callable[[Outputs], AsyncIterator[str]],
    usage_chunk: Callable[[], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """A streaming response: the frames `frames` makes of the job's merged outputs, then the
    usage chunk when the request asks for one, then `[DONE]`; on any error an error frame and
    `[DONE]` instead of the rest. The merged streams and the job close however it ends."""
    merged = merge_streams(job.streams)
    body = frames(merged)
    try:
        async for frame in body:
            yield frame
        if usage_chunk is not None:
            yield sse(usage_chunk())
        yield sse("[DONE]")
    except (MetraleError, Exception) as exc:
        async for frame in error_frames(exc):
            yield frame
    finally:
        await body.aclose()
        await merged.aclose()
        job.close()
