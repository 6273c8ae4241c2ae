"""Per-request sampling parameters: the validated, normalised form of what a client asked for.

Owner: sampling. The server builds a `SamplingParams` from a request body, the engine and
scheduler read it (stop conditions, token budgets, logprob counts), the sampler reads it for
each row it samples. This module is pure Python and must never import torch: the scheduler
core depends on it.

Invariants:
- A constructed `SamplingParams` is valid: `__post_init__` checks every field and raises
  `InvalidRequestError` whose message and `param` name the offending field.
- Fields are normalised once: `stop` is a `list[str]` (a single string becomes a one-element
  list), `stop_token_ids` a `list[int]`, `logit_bias` a `dict[int, float]` or None (string
  keys of integers, as OpenAI clients send them, become ints), integral numbers are `int`,
  real numbers `float`.
- Treat an instance as immutable once built (it may be shared by the `n` choices of a request):
  derive a changed copy with `replace(...)`, which validates again.
- `top_k` of 0 or -1 means "off"; `top_p == 1.0` and `min_p == 0.0` mean "off";
  `temperature < GREEDY_TEMPERATURE` means greedy (argmax).
- The stop-token rule lives here alone: `stop_reason` (the scheduler ends a request by it) and
  `masked_stop_token_ids` (the sampler masks those ids) agree through `stop_tokens_allowed`,
  so a masked token can never be the one that would have stopped the request.
- `derive_choice_seed(seed, 0) == seed`, so a single-choice request samples with the seed the
  client sent; other choices get independent, deterministic seeds.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.sampling.structured import GrammarSpec

#: Temperatures below this sample greedily (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
#: Upper bound of `logprobs` and `prompt_logprobs` (OpenAI's `top_logprobs` limit).
MAX_LOGPROBS = 20
#: How an embedding pools a prompt's final hidden states (None: no embedding).
POOLING_TYPES = (None, "mean", "last")
#: Bounds of presence/frequency penalties (OpenAI's documented range).
MAX_ABS_PENALTY = 2.0
#: Bound of each logit_bias value (OpenAI's documented range).
MAX_ABS_LOGIT_BIAS = 100.0

_MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """The SplitMix64 finaliser: a fast bijective mix of a 64-bit integer (taken mod 2**64)."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(seed: int, *parts: int) -> int:
    """A 64-bit seed derived deterministically from `seed` and `parts` (any Python ints)."""
    h = splitmix64(seed & _MASK64)
    for part in parts:
        h = splitmix64(h ^ (part & _MASK64))
    return h


def row_uniform(seed: int, step: int) -> float:
    """The uniform in (0, 1) of a seeded row's draw number `step` (pure function of both)."""
    return uniform_from_bits(mix_seed(seed, step) >> 11)


def uniform_from_bits(bits53: int) -> float:
    """53 random bits as a float in (0, 1): the bin's midpoint, never 0 nor 1."""
    return (bits53 + 0.5) * 2.0**-53


def derive_choice_seed(seed: int | None, choice_index: int) -> int | None:
    """The effective seed of choice `choice_index` of a request seeded with `seed`.

    Choice 0 keeps the client's seed; choice i > 0 gets an independent mix of (seed, i), so the
    `n` choices of a seeded request differ from each other yet repeat across runs.
    """
    if seed is None:
        return None
    if choice_index == 0:
        return seed
    return mix_seed(seed, choice_index)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_int(value: Any, name: str) -> int:
    """`value` as an int; integral floats (2.0, as JSON may carry) are accepted."""
    if _is_int(value):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)


def _as_float(value: Any, name: str) -> float:
    """`value` as a finite float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", param=name)
    result = float(value)
    if not math.isfinite(result):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    return result


def _normalise_stop(value: Any, name: str = "stop") -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise InvalidRequestError(
            f"{name} must be a string or a list of strings, got {value!r}", param=name
        )
    result: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise InvalidRequestError(f"{name} must contain only strings, got {item!r}", param=name)
        if not item:
            raise InvalidRequestError(f"{name} strings must not be empty", param=name)
        result.append(item)
    return result


def _normalise_token_ids(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list | tuple | set | frozenset):
        raise InvalidRequestError(f"{name} must be a list of token ids, got {value!r}", param=name)
    result: list[int] = []
    for item in value:
        token = _as_int(item, name)
        if token < 0:
            raise InvalidRequestError(f"{name} must hold token ids >= 0, got {item!r}", param=name)
        result.append(token)
    return result


def _normalise_logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"logit_bias must map token ids to numbers, got {value!r}", param="logit_bias"
        )
    result: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, str):
            try:
                token = int(key.strip())
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (integers), got {key!r}",
                    param="logit_bias",
                ) from None
        elif _is_int(key):
            token = int(key)
        else:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (integers), got {key!r}", param="logit_bias"
            )
        if token < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids >= 0, got {key!r}", param="logit_bias"
            )
        amount = _as_float(bias, "logit_bias")
        if not -MAX_ABS_LOGIT_BIAS <= amount <= MAX_ABS_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias values must be in [-100, 100], got {bias!r} for token {key!r}",
                param="logit_bias",
            )
        if token in result:
            raise InvalidRequestError(
                f"logit_bias names token {token} more than once", param="logit_bias"
            )
        result[token] = amount
    return result


def _optional_logprob_count(value: Any, name: str) -> int | None:
    if value is None:
        return None
    count = _as_int(value, name)
    if not 0 <= count <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"{name} must be between 0 and {MAX_LOGPROBS}, got {value!r}", param=name
        )
    return count


def _as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be a boolean, got {value!r}", param=name)
    return value


@dataclass
class SamplingParams:
    """How to pick the tokens of one request (all its `n` choices), vLLM's fields and defaults."""

    #: Number of independent choices to generate for the request.
    n: int = 1
    #: Softmax temperature; below `GREEDY_TEMPERATURE` the token is the argmax.
    temperature: float = 1.0
    #: Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    top_p: float = 1.0
    #: Keep the `top_k` most likely tokens; 0 or -1 turns it off.
    top_k: int = 0
    #: Keep tokens whose probability is at least `min_p` times the top token's.
    min_p: float = 0.0
    #: HF/vLLM rule over prompt + output tokens: positive logits / penalty, others * penalty.
    repetition_penalty: float = 1.0
    #: OpenAI rule over output tokens: logit -= presence_penalty if the token occurred.
    presence_penalty: float = 0.0
    #: OpenAI rule over output tokens: logit -= count * frequency_penalty.
    frequency_penalty: float = 0.0
    #: Added to the logits of the named token ids before sampling (also when greedy).
    logit_bias: dict[int, float] | None = None
    #: Seed of the random draws; the engine derives each choice's seed (`derive_choice_seed`).
    seed: int | None = None
    #: Most tokens to generate; None means up to the context limit (the engine resolves it).
    max_tokens: int | None = 16
    #: Fewest tokens to generate: EOS and `stop_token_ids` are masked until reached.
    min_tokens: int = 0
    #: Strings that end generation (a single string is accepted and becomes a list).
    stop: list[str] = field(default_factory=list)
    #: Token ids that end generation (in addition to the model's EOS ids).
    stop_token_ids: list[int] = field(default_factory=list)
    #: EOS does not end generation (it can still be sampled).
    ignore_eos: bool = False
    #: Top alternatives to report per generated token; 0 reports only the chosen token's.
    logprobs: int | None = None
    #: Top alternatives to report per prompt token; 0 reports only the prompt token's.
    prompt_logprobs: int | None = None
    #: Leave special tokens out of the detokenized text.
    skip_special_tokens: bool = True
    #: Keep the matched stop string at the end of the output text.
    include_stop_str_in_output: bool = False
    #: Constrain the output to a grammar (JSON schema, regex, choice, EBNF, tool calls); the
    #: engine compiles it with xgrammar (`metrale.sampling.grammar`).
    structured_outputs: GrammarSpec | None = None
    #: Only these token ids may be sampled (vLLM's `allowed_token_ids`); None: any.
    allowed_token_ids: list[int] | None = None
    #: Words never generated (vLLM's `bad_words`): the engine resolves each to its token ids
    #: (`bad_words_token_ids`, with and without a leading space); the last token of a word is
    #: masked whenever the output ends with the ones before it.
    bad_words: list[str] = field(default_factory=list)
    #: `bad_words` as token-id sequences, set by the engine at admission (not by clients).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    #: Embeddings (set by `/v1/embeddings`, not a sampling choice): "mean" or "last" pools
    #: the final hidden states of the prompt into `RequestOutput.embedding` (L2-normalised);
    #: such a request reuses no cached prefix and generates one token, discarded.
    pooling: str | None = None

    def __post_init__(self) -> None:
        self.n = _as_int(self.n, "n")
        if self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}", param="n")

        self.temperature = _as_float(self.temperature, "temperature")
        if self.temperature < 0.0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )

        self.top_p = _as_float(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")

        self.top_k = _as_int(self.top_k, "top_k")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k}",
                param="top_k",
            )

        self.min_p = _as_float(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")

        self.repetition_penalty = _as_float(self.repetition_penalty, "repetition_penalty")
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                param="repetition_penalty",
            )

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(getattr(self, name), name)
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", param=name)
            setattr(self, name, value)

        self.logit_bias = _normalise_logit_bias(self.logit_bias)

        if self.seed is not None:
            self.seed = _as_int(self.seed, "seed")

        if self.max_tokens is not None:
            self.max_tokens = _as_int(self.max_tokens, "max_tokens")
            if self.max_tokens < 1:
                raise InvalidRequestError(
                    f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
                )

        self.min_tokens = _as_int(self.min_tokens, "min_tokens")
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )

        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_token_ids(self.stop_token_ids, "stop_token_ids")
        self.ignore_eos = _as_bool(self.ignore_eos, "ignore_eos")
        self.logprobs = _optional_logprob_count(self.logprobs, "logprobs")
        self.prompt_logprobs = _optional_logprob_count(self.prompt_logprobs, "prompt_logprobs")
        self.skip_special_tokens = _as_bool(self.skip_special_tokens, "skip_special_tokens")
        self.include_stop_str_in_output = _as_bool(
            self.include_stop_str_in_output, "include_stop_str_in_output"
        )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, GrammarSpec
        ):
            raise InvalidRequestError(
                "structured_outputs must be a GrammarSpec", param="structured_outputs"
            )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _normalise_token_ids(
                self.allowed_token_ids, "allowed_token_ids"
            )
            if not self.allowed_token_ids:
                raise InvalidRequestError(
                    "allowed_token_ids must not be empty", param="allowed_token_ids"
                )
        self.bad_words = _normalise_stop(self.bad_words, "bad_words")
        if self.pooling not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling must be one of {', '.join(map(str, POOLING_TYPES))}, got "
                f"{self.pooling!r}",
                param="pooling",
            )

    # ---------------------------------------------------------------------------------------
    # Derived views
    # ---------------------------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax of the processed logits (no random draw)."""
        return self.temperature < GREEDY_TEMPERATURE

    def top_k_filters(self, vocab: int) -> bool:
        """Whether top-k removes tokens from a vocabulary of `vocab` (0 < top_k < vocab)."""
        return 0 < self.top_k < vocab

    @property
    def top_p_enabled(self) -> bool:
        return self.top_p < 1.0

    @property
    def min_p_enabled(self) -> bool:
        return self.min_p > 0.0

    @property
    def uses_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Reject token ids (logit_bias keys, stop_token_ids) outside `[0, vocab_size)`.

        The engine calls this once it knows the model; the sampler itself ignores ids it has
        no logit for rather than failing a whole batch.
        """
        for token in self.logit_bias or {}:
            if token >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias names token {token}, outside the vocabulary of {vocab_size}",
                    param="logit_bias",
                )
        for name in ("stop_token_ids", "allowed_token_ids"):
            for token in getattr(self, name) or ():
                if token >= vocab_size:
                    raise InvalidRequestError(
                        f"{name} holds {token}, outside the vocabulary of {vocab_size}",
                        param=name,
                    )

    @property
    def needs_known_output(self) -> bool:
        """True when sampling a step must see every earlier output token on the host (a
        bad word of several tokens is banned by what the output ends with), so such a row is
        never launched on the device token feed."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids)

    def banned_tokens(self, output_token_ids: Sequence[int]) -> set[int]:
        """The tokens `bad_words_token_ids` forbid after `output_token_ids`."""
        banned = set()
        for ids in self.bad_words_token_ids:
            head = ids[:-1]
            if not head or list(output_token_ids[len(output_token_ids) - len(head) :]) == head:
                banned.add(ids[-1])
        return banned

    # ---------------------------------------------------------------------------------------
    # The stop-token rule (the sampler masks by it, the scheduler stops by it)
    # ---------------------------------------------------------------------------------------

    def stop_tokens_allowed(self, n_out: int) -> bool:
        """Whether a stop token (EOS or one of `stop_token_ids`) may follow `n_out` generated
        tokens: only once `min_tokens` are generated (before that the sampler masks them)."""
        return n_out >= self.min_tokens

    def masked_stop_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The token ids masked while `stop_tokens_allowed` is False: `stop_token_ids` and the
        model's EOS ids, whatever `ignore_eos` says (it only decides whether EOS stops)."""
        return frozenset((*self.stop_token_ids, *eos_token_ids))

    def stop_reason(
        self, token: int, n_out: int, eos_token_ids: Collection[int]
    ) -> tuple[str | None, int | None]:
        """Whether `token`, generated after `n_out` tokens, stops the request by a stop token:
        `("stop", token)` for one of `stop_token_ids` (checked first), `("stop", None)` for an
        EOS id unless `ignore_eos`, `(None, None)` otherwise and while `stop_tokens_allowed`
        is False. (The length limits are the scheduler's.)"""
        if self.stop_tokens_allowed(n_out):
            if token in self.stop_token_ids:
                return "stop", token
            if not self.ignore_eos and token in eos_token_ids:
                return "stop", None
        return None, None

    # ---------------------------------------------------------------------------------------
    # Copies
    # ---------------------------------------------------------------------------------------

    def clone(self) -> SamplingParams:
        """A deep copy (lists and dicts are not shared with this instance)."""
        return copy.deepcopy(self)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with `changes` applied, validated again; containers are not shared."""
        return dataclasses.replace(self.clone(), **changes)
