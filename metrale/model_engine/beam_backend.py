"""A beam search's request and result types and its model side: `BeamParams` (checked at
construction), `BeamRequest`, `BeamHypothesis`, `BeamOutput`, the `BeamBackend` protocol the
driver (`beam.py`) reaches a model through, `fork_state` (a forked sequence's KV view), and
`DecoderOnlyBeamBackend`, the backend over a decoder-only `TransformerModel`.

Owner: model-engine. Invariants:
- A `BeamParams` that exists is valid: a bad field raises `InvalidRequestError` naming it.
  The `early_stopping` rule is `check_early_stopping`, its one home (the translation server
  checks a request's value with it too).
- A backend's `beam_start_batch` either starts every request or frees every sequence it
  made and raises; `beam_fork` gives the child one more reference to each shared block.
- `DecoderOnlyBeamBackend` prefills a prompt but its last token through the model's prefix
  cache (a repeated prompt prefills only its unmatched tail) and refuses models with
  recurrent layers (a fork would need a copy of the recurrent state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from metrale.cache.block_pool import BlockPool
from metrale.cache.kv_cache import PagedKVCache
from metrale.errors import InvalidRequestError
from metrale.model_engine.traits import SequenceState


def check_early_stopping(value: object) -> None:
    """`early_stopping` is True, False or "never" (transformers' values); anything else is an
    `InvalidRequestError` naming it. `BeamParams` and the translation server (which forces
    True for one beam, after checking the request's value) both check it here."""
    if value not in (True, False, "never"):
        raise InvalidRequestError(
            f"early_stopping must be true, false or 'never', got {value!r}",
            param="early_stopping",
        )


@dataclass(frozen=True)
class BeamParams:
    """A beam-search request's parameters (transformers' `generate` names in comments)."""

    num_beams: int = 4
    #: Hypotheses returned (`num_return_sequences`), at most `num_beams`.
    n: int = 1
    length_penalty: float = 1.0
    #: True, False or "never", with transformers' meaning.
    early_stopping: bool | str = False
    #: New tokens after the forced prefix (`max_new_tokens` minus the prefix).
    max_tokens: int = 16
    #: EOS is banned until this many tokens follow the forced prefix.
    min_tokens: int = 0
    no_repeat_ngram_size: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} {msg}", param=name)

        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise bad("num_beams", f"must be an integer >= 1, got {self.num_beams!r}")
        if not isinstance(self.n, int) or not 1 <= self.n <= self.num_beams:
            raise bad("n", f"must be between 1 and num_beams ({self.num_beams}), got {self.n!r}")
        check_early_stopping(self.early_stopping)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be between 0 and max_tokens, got {self.min_tokens!r}")
        if not isinstance(self.no_repeat_ngram_size, int) or self.no_repeat_ngram_size < 0:
            raise bad(
                "no_repeat_ngram_size",
                f"must be an integer >= 0, got {self.no_repeat_ngram_size!r}",
            )
        if (
            not isinstance(self.length_penalty, (int, float))
            or self.length_penalty != self.length_penalty
        ):
            raise bad("length_penalty", f"must be a number, got {self.length_penalty!r}")


@dataclass
class BeamRequest:
    request_id: str
    #: Decoder-only: the prompt. Encoder-decoder: the decoder's prompt (its start token).
    prompt: list[int]
    params: BeamParams
    #: Encoder-decoder: the encoder's input ids; None for decoder-only models.
    source: list[int] | None = None
    #: Tokens forced as the first generated ones (the target language code); they score 0
    #: and count toward the length as in transformers (`forced_bos_token_id`).
    forced: list[int] = field(default_factory=list)


@dataclass
class BeamHypothesis:
    #: Generated tokens after the forced prefix, the EOS that ended it included.
    token_ids: list[int]
    score: float
    finish_reason: str  # "stop" | "length"


@dataclass
class BeamOutput:
    request_id: str
    hypotheses: list[BeamHypothesis]
    prompt_token_ids: list[int]
    #: Decoder forwards this request took part in.
    steps: int


class BeamBackend(Protocol):
    """What the driver needs of a model."""

    block_pool: BlockPool
    kv_cache: PagedKVCache
    block_size: int

    def beam_start(self, req: BeamRequest) -> SequenceState:
        """A sequence that has processed `req.prompt[:-1]` (and, encoder-decoder, encoded the
        source); the driver feeds `req.prompt[-1]` in the next step's forward."""
        ...

    def beam_start_batch(self, reqs: Sequence[BeamRequest]) -> list[SequenceState]:
        """`beam_start` of each request, in order (a raise frees every sequence made)."""
        ...

    def beam_fork(self, seq: SequenceState) -> SequenceState:
        """A new sequence sharing `seq`'s blocks (one more reference each) and state."""
        ...

    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState]) -> torch.Tensor:
        """One token per sequence; float32 logits `[rows, vocab]`."""
        ...

    def free_sequence(self, seq: SequenceState) -> None: ...

    def vocab_size(self) -> int: ...


@contextmanager
def freed_on_raise(free: Callable[[SequenceState], None]) -> Iterator[list[SequenceState]]:
    """A list for the sequences a `beam_start_batch` makes: if the block raises, each one
    in it is freed (`free`) before the exception goes on, so a failed start holds nothing."""
    seqs: list[SequenceState] = []
    try:
        yield seqs
    except BaseException:
        for seq in seqs:
            free(seq)
        raise


def fork_state(seq: SequenceState, child: SequenceState) -> SequenceState:
    """Make `child` (a fresh sequence) a copy of `seq`'s KV view; the caller increfs."""
    child.tokens = list(seq.tokens)
    child.block_table = list(seq.block_table)
    child.seq_len = seq.seq_len
    child.kv_valid_tokens = seq.kv_valid_tokens
    child.prompt_len = seq.prompt_len
    child.layer_states = list(seq.layer_states)
    child.adapter_id = seq.adapter_id
    child.src_lang_id, child.tgt_lang_id = seq.src_lang_id, seq.tgt_lang_id
    child.num_beams, child.length_penalty = seq.num_beams, seq.length_penalty
    child.early_stopping = seq.early_stopping
    return child


class DecoderOnlyBeamBackend:
    """`BeamBackend` over a decoder-only `TransformerModel` (its pool, its forwards)."""

    def __init__(self, model: Any) -> None:
        if model.has_ssm_layers():
            raise InvalidRequestError(
                "beam search is not supported on models with recurrent (SSM) layers: a beam "
                "fork would need a copy of the recurrent state"
            )
        self.model = model
        #: Request id -> its prompt tokens whose KV came from the prefix cache.
        self.reused_prompt_tokens: dict[str, int] = {}
        self.block_pool = model.block_pool
        self.kv_cache = model.kv_cache
        self.block_size = model.block_size

    def beam_start(self, req: BeamRequest) -> SequenceState:
        """Prefill the prompt but its last token, reusing (and then extending) the model's
        prefix cache: a prompt seen before costs only its unmatched tail."""
        model = self.model
        seq = model.alloc_sequence()
        head = req.prompt[:-1]
        try:
            reused = model.lookup_prefix(seq, head) if head else 0
            if len(head) > reused:
                model.prefill_chunk(head, seq, reused, len(head) - reused, True)
            model.cache_sequence(seq)
        except BaseException:
            model.free_sequence(seq)
            raise
        self.reused_prompt_tokens[req.request_id] = reused
        seq.prompt_len = len(req.prompt)
        return seq

    def beam_start_batch(self, reqs: Sequence[BeamRequest]) -> list[SequenceState]:
        with freed_on_raise(self.free_sequence) as seqs:
            for req in reqs:
                seqs.append(self.beam_start(req))
        return seqs

    def beam_fork(self, seq: SequenceState) -> SequenceState:
        child = fork_state(seq, self.model.alloc_sequence())
        self.block_pool.incref(child.block_table)
        return child

    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState]) -> torch.Tensor:
        return self.model.decode_batch(tokens, seqs)

    def free_sequence(self, seq: SequenceState) -> None:
        self.model.free_sequence(seq)

    def vocab_size(self) -> int:
        return int(self.model.vocab_size())
