"""The speculative decoding configuration: one per engine, parsed from the
`speculative_config` JSON object (vLLM's shape) and checked before anything starts.

Owner: spec. `SpeculativeConfig.from_dict` / `from_json` are the only parsers; the CLI and the
server hand them the user's object as it came.

Invariants:
- A `SpeculativeConfig` that exists is valid: construction checks every field, so a config
  built in code is held to the same rules as a parsed one.
- Every refused key or value raises `InvalidRequestError` with `param` set to
  `speculative_config.<key>` and a message naming the key and what it allows.
- Unknown keys are refused, never ignored (a misspelt key must not silently do nothing).
- Booleans are not integers here (`True` is refused where an int is expected).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.spec.ngram import NgramProposer
from metrale.spec.proposer import Proposer
from metrale.spec.suffix import SuffixProposer

METHODS = ("ngram", "suffix", "mtp", "draft_model")
#: Methods whose drafts come from a model (built by the engine, not by `make_proposer`).
MODEL_METHODS = ("mtp", "draft_model")
GATES = ("auto", "off")
#: Most draft tokens one row may verify per step.
MAX_SPECULATIVE_TOKENS = 16
#: Longest n-gram the lookups match (bounds the per-token indexing work).
MAX_PROMPT_LOOKUP = 32

_PREFIX = "speculative_config"


def _param(key: str) -> str:
    return f"{_PREFIX}.{key}"


def _check_int(key: str, value: Any, lo: int, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi] (hi None: no upper bound), or an InvalidRequestError."""
    allowed = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(
            f"{_param(key)} must be {allowed}, got {value!r} ({type(value).__name__})",
            param=_param(key),
        )
    if value < lo or (hi is not None and value > hi):
        raise InvalidRequestError(
            f"{_param(key)} must be {allowed}, got {value}", param=_param(key)
        )
    return value


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise InvalidRequestError(
            f"{_param(key)} must be one of {allowed}, got {value!r}", param=_param(key)
        )
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: which proposer, how many drafts, and the gate."""

    #: "ngram" (the sequence's own prompt lookup), "suffix" (own lookup, then the
    #: tenant's shared cross-request index), "mtp" (the checkpoint's multi-token-prediction
    #: head) or "draft_model" (a smaller checkpoint, `model`, with the same vocabulary).
    method: str
    #: Most draft tokens a row verifies per step (k), 1..16.
    num_speculative_tokens: int
    #: Shortest suffix n-gram a lookup accepts as a match.
    prompt_lookup_min: int = 2
    #: Longest suffix n-gram tried first (the lookups prefer the longest match).
    prompt_lookup_max: int = 5
    #: Token budget of the shared suffix index over all tenants (method "suffix"); about
    #: 500 bytes of host memory per token with n = 2..5, so the default is about 130 MB.
    suffix_cache_max_tokens: int = 262_144
    #: "auto": the throughput gate may turn speculation off; "off": always speculate when a
    #: draft exists.
    gate: str = "auto"
    #: Steps per gate measurement window.
    gate_window: int = 16
    #: Tokens of plain decode between the gate's probes of speculation.
    gate_probe_tokens: int = 256
    #: The draft checkpoint's directory (method "draft_model" only, where it is required).
    model: str | None = None

    def __post_init__(self) -> None:
        _check_choice("method", self.method, METHODS)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_PROMPT_LOOKUP)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise InvalidRequestError(
                f"{_param('prompt_lookup_max')} must be an integer in "
                f"prompt_lookup_min..{MAX_PROMPT_LOOKUP} ({self.prompt_lookup_min}.."
                f"{MAX_PROMPT_LOOKUP}), got {self.prompt_lookup_max}",
                param=_param("prompt_lookup_max"),
            )
        _check_int("suffix_cache_max_tokens", self.suffix_cache_max_tokens, 1)
        _check_choice("gate", self.gate, GATES)
        _check_int("gate_window", self.gate_window, 1)
        _check_int("gate_probe_tokens", self.gate_probe_tokens, 1)
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise InvalidRequestError(
                    f"{_param('model')} is required for method 'draft_model': the draft "
                    "checkpoint's directory",
                    param=_param("model"),
                )
        elif self.model is not None:
            raise InvalidRequestError(
                f"{_param('model')} is only used by method 'draft_model' (method is "
                f"{self.method!r})",
                param=_param("model"),
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeculativeConfig:
        """Parse the `speculative_config` object. `method` and `num_speculative_tokens` are
        required; when only `prompt_lookup_min` is given and it exceeds the default maximum,
        the maximum follows it (min 7 alone means 7..7, not an error)."""
        if not isinstance(d, Mapping):
            raise InvalidRequestError(
                f"{_PREFIX} must be a JSON object, got {type(d).__name__}", param=_PREFIX
            )
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                raise InvalidRequestError(
                    f"{_param(str(key))} is not a known key; allowed keys: {', '.join(known)}",
                    param=_param(str(key)),
                )
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise InvalidRequestError(f"{_param(key)} is required", param=_param(key))
        values = dict(d)
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            lo = values["prompt_lookup_min"]
            if isinstance(lo, int) and not isinstance(lo, bool) and lo > cls.prompt_lookup_max:
                values["prompt_lookup_max"] = lo
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parse a JSON text holding the `speculative_config` object."""
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise InvalidRequestError(
                f"{_PREFIX} is not valid JSON: {exc}", param=_PREFIX
            ) from None
        return cls.from_dict(d)

    def describe(self) -> str:
        """One line for the start-up log, e.g. "ngram k=4 n=2..5 gate=auto"."""
        text = (
            f"{self.method} k={self.num_speculative_tokens} "
            f"n={self.prompt_lookup_min}..{self.prompt_lookup_max}"
        )
        if self.method == "suffix":
            text += f" cache={self.suffix_cache_max_tokens}"
        if self.method == "draft_model":
            text += f" model={self.model}"
        text += f" gate={self.gate}"
        if self.gate == "auto":
            text += f" window={self.gate_window} probe={self.gate_probe_tokens}"
        return text

    @property
    def uses_model(self) -> bool:
        """Whether the drafts come from a model (MTP head, draft checkpoint): the engine
        builds that proposer; `make_proposer` builds the host ones."""
        return self.method in MODEL_METHODS

    def make_proposer(self) -> Proposer:
        """A fresh proposer of this config's host method (ngram, suffix)."""
        if self.uses_model:
            raise ValueError(f"method {self.method!r} drafts with a model: the engine builds it")
        if self.method == "ngram":
            return NgramProposer(
                self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
            )
        return SuffixProposer(
            self.num_speculative_tokens,
            self.prompt_lookup_min,
            self.prompt_lookup_max,
            self.suffix_cache_max_tokens,
        )
