"""The scheduler's view of one generation stream (one choice of a request).

Owner: scheduler. The engine creates `SchedSequence`s; the scheduler moves them between its
queues and owns their model-engine `SequenceState` while they hold device resources.

Invariants:
- `all_tokens` (prompt + output) are the tokens known; `num_computed` of them have KV written
  (`state.seq_len`, 0 without a state). Every forward makes `num_computed` catch up with the
  known tokens; when it catches up fully, the last row's logits sample a new token.
- `state` is not None exactly while the sequence holds device resources (RUNNING).
- A FINISHED sequence never holds a state, a swap record or a queue position.
- `max_tokens` is the resolved budget (>= 1, within the context); the scheduler never reads
  `params.max_tokens`.
- `vision` (the prompt's images) is opaque here and travels with the sequence across
  preemption and swap; `prefix_tokens()` is `all_tokens` keyed by it for the prefix cache.
- `spec_token_ids` are draft tokens for the next step only: never part of `all_tokens`, set
  by the engine's proposer before `Scheduler.schedule` and cleared by it (a row computes its
  last token plus the drafts the plan gave it; the verdict commits the accepted prefix).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, overload

from metrale.model_engine.traits import PromptTokenLogprob, SequenceState
from metrale.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class SwapRecord:
    """A swapped-out sequence's device state, kept in host memory (or, past the swap space,
    in a temporary file: `on_disk`)."""

    data: IO[bytes]
    num_blocks: int
    seq_len: int
    nbytes: int
    on_disk: bool = False


class TokenView(Sequence[int]):
    """A sequence's prompt then output, read in place (no copy): what a proposer reads
    every step, where `all_tokens` would build a new list per row."""

    __slots__ = ("_output", "_prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt = prompt
        self._output = output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return (self._prompt + self._output)[i]
        n = len(self._prompt)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("token index out of range")
        return self._prompt[i] if i < n else self._output[i - n]


#: Prompt tokens that name a session when the request names none: the turns of one
#: conversation share their opening (system prompt and first message).
SESSION_PREFIX_TOKENS = 64


def session_hash(namespace: int, session_id: str | None, prompt: Sequence[int]) -> int:
    """The SSM snapshot store's session tag of a sequence (never 0): a hash of its prefix
    namespace and `session_id`, or, without one, of its first `SESSION_PREFIX_TOKENS` prompt
    tokens (stable across processes)."""
    if session_id:
        raw = f"{namespace}\0id\0{session_id}".encode("utf-8", "surrogatepass")
    else:
        head = ",".join(map(str, prompt[:SESSION_PREFIX_TOKENS]))
        raw = f"{namespace}\0tokens\0{head}".encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") | 1


def prefix_namespace(adapter_id: int, cache_namespace: str | None) -> int:
    """The prefix cache's namespace key of a sequence: its adapter id, or, with a
    `cache_namespace`, a 62-bit hash of both with bit 62 set (never a plain adapter id), so
    namespaces never share blocks (stable across processes)."""
    if not cache_namespace:
        return adapter_id
    raw = f"{adapter_id}\0{cache_namespace}".encode("utf-8", "surrogatepass")
    digest = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return (1 << 62) | (digest & ((1 << 62) - 1))


@dataclass(eq=False)
class SchedSequence:
    seq_id: str
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    #: The output budget, resolved by `Engine.check_prompt` (a request's `max_tokens=None`
    #: becomes the context room left). The one the scheduler reads: `params.max_tokens` is the
    #: request as written, and nothing after `check_prompt` reads it.
    max_tokens: int
    eos_token_ids: frozenset[int]
    #: Effective sampling seed of this choice (None: the engine's generator).
    seed: int | None = None
    adapter_id: int = 0
    #: Absolute monotonic deadline, or None.
    deadline: float | None = None
    arrival: int = 0
    #: The request's priority (lower is served first under the "priority" policy).
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    state: SequenceState | None = None
    swap: SwapRecord | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    #: Output length when the sequence last resumed from a preemption (immunity window).
    resumed_at: int | None = None
    num_preemptions: int = 0
    #: Prompt tokens served from the prefix cache on the first admission.
    num_cached_tokens: int = 0
    #: Prompt logprobs, kept here once complete (they survive preemption).
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    #: The prompt's pooled final hidden state (`params.pooling`), once its prefill ended.
    embedding: list[float] | None = None
    #: Whether this request may speculate (the per-request opt-out sets False).
    speculative: bool = True
    #: Tenant of the cross-request draft lookup; None keeps it out of every shared index.
    lookup_tenant: str | None = None
    #: Prefix-cache namespace beyond the adapter (a tenant and/or a request's `cache_salt`):
    #: sequences of different namespaces never share prefix-cache blocks; None: the
    #: adapter's shared one.
    cache_namespace: str | None = None
    #: The conversation this request continues (a client's `session_id` / `user`); None: the
    #: session is derived from the prompt's opening tokens (`session_hash`).
    session_id: str | None = None
    #: False while something the engine needs before admission is not there yet (its
    #: output grammar compiling): a waiting sequence is admitted only once ready.
    ready: bool = True
    #: The prompt's images (`model_engine.vision.VisionInputs`, opaque here); None for text.
    vision: Any = None

    def prefix_tokens(self) -> list[int]:
        """`all_tokens` as the prefix cache keys them: image pad tokens carry their image's
        hash (`vision.key_tokens`), so different images never share blocks."""
        tokens = self.all_tokens
        return tokens if self.vision is None else self.vision.key_tokens(tokens)

    @property
    def prefix_namespace(self) -> int:
        """The prefix cache's key of this sequence's namespace (`prefix_namespace`)."""
        return prefix_namespace(self.adapter_id, self.cache_namespace)

    #: Drafts proposed for the next step (see the invariants); empty when none.
    spec_token_ids: list[int] = field(default_factory=list)
    #: Draft tokens this stream verified, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed(self) -> int:
        return self.state.seq_len if self.state is not None else 0

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_view(self) -> TokenView:
        """`all_tokens` without the copy (it follows the output as it grows)."""
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def wants_embedding(self) -> bool:
        return self.params.pooling is not None and self.embedding is None

    @property
    def reads_whole_prompt(self) -> bool:
        """Whether prefill must compute every prompt position (prompt logprobs or an
        embedding still wanted): no cached prefix is reused, no swap keeps it."""
        return self.wants_prompt_logprobs or self.wants_embedding

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def is_decoding(self) -> bool:
        """One known token left to compute and it is a generated one: a decode row."""
        # num_known - num_computed == 1, spelled out: called for every row several times a step.
        out = self.output_token_ids
        state = self.state
        if not out:
            return False
        computed = state.seq_len if state is not None else 0
        return len(self.prompt_token_ids) + len(out) - computed == 1
