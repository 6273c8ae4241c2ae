"""Request and output types of the engine, shaped like vLLM's so users know them.

Owner: engine. The server and the offline `LLM` read `RequestOutput`s; nothing below the
engine sees these types.

Invariants:
- `RequestOutput` is cumulative: each one holds everything produced so far, and the `text` of
  a choice only ever grows (stop-string holdback and partial UTF-8 are resolved before text is
  exposed), so streaming deltas are suffixes.
- `finish_reason` is one of "stop", "length", "abort", "timeout", "error" once finished.
- `num_cached_tokens` is the prompt tokens whose KV was read from the prefix cache (0 when
  nothing was reused); it is always present.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    #: 1-based rank among the vocabulary (None when not computed).
    rank: int | None = None
    decoded_token: str | None = None


#: One position: token id -> its Logprob (the chosen token plus the top-N alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    #: The stop string or stop token id that ended the choice, if any.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    #: `[None, {token: Logprob}, ...]`: the first prompt token has no score.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: An embedding request's pooled, L2-normalised final hidden state (in the final output).
    embedding: list[float] | None = None
    num_cached_tokens: int = 0
    #: Timings in seconds since the request arrived (monotonic clock).
    metrics: dict[str, float] = field(default_factory=dict)
    #: Set when the request ended because of an error; the message a client may see.
    error: str | None = None
