"""What a request constrains its output to: the grammar spec carried by `SamplingParams`.

Owner: sampling. The server turns OpenAI's `response_format`, vLLM's `structured_outputs` and
`guided_*` fields, Anthropic's `output_config.format` and tool-call constraints into one
`GrammarSpec`; the engine compiles it (`metrale.sampling.grammar`) and masks every sampled
token of the request by it. Pure Python (no torch, no xgrammar): the scheduler side and the
engine process's pipe carry it as a plain value.

Invariants:
- A constructed `GrammarSpec` is well-formed: `kind` is one of `KINDS` and `value` a string
  of the shape that kind needs (`choice`: a JSON list of strings; `json_schema` and
  `structural_tag`: a JSON object); a bad one raises `InvalidRequestError` naming `param`.
  Whether the grammar engine supports its constructs is decided at compile time.
- `key` identifies the compiled grammar: two specs with the same key compile to the same
  grammar (the compile cache's key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from metrale.errors import InvalidRequestError

__all__ = ["KINDS", "GrammarSpec"]

#: The kinds of constraint: a JSON schema, any JSON object, a regular expression, one of
#: several strings, an EBNF (GBNF) grammar, an xgrammar structural tag (tool calls).
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """One output constraint: `kind` (of `KINDS`) and its text (`value`)."""

    kind: str
    #: json_schema / structural_tag: canonical JSON text; regex / grammar: the source;
    #: choice: a JSON list of the strings; json_object: "".
    value: str = ""
    #: The request field it came from, named by errors (e.g. "response_format").
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"{self.param}: unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})",
                param=self.param,
            )
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"{self.param} must be text", param=self.param)
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError(f"{self.param}: the {self.kind} is empty", param=self.param)
        if self.kind == "choice":
            choices = json.loads(self.value) if self.value else None
            if not isinstance(choices, list) or not choices:
                raise InvalidRequestError(
                    f"{self.param}: choice needs a non-empty list of strings", param=self.param
                )
            if not all(isinstance(c, str) for c in choices):
                raise InvalidRequestError(
                    f"{self.param}: choice must hold only strings", param=self.param
                )

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)

    # ------------------------------------------------------------------ builders

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> GrammarSpec:
        """A JSON-schema constraint; `schema` a dict (or JSON text of one)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(
                    f"{param}: the JSON schema is not valid JSON ({exc})", param=param
                ) from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{param}: the JSON schema must be an object, got {type(schema).__name__}",
                param=param,
            )
        return cls("json_schema", canonical_json(schema), param)

    @classmethod
    def choice(cls, choices: Any, param: str) -> GrammarSpec:
        if not isinstance(choices, list):
            raise InvalidRequestError(f"{param} must be a list of strings", param=param)
        return cls("choice", json.dumps(choices, ensure_ascii=False), param)

    @classmethod
    def text(cls, kind: str, value: Any, param: str) -> GrammarSpec:
        """A regex or grammar constraint from its source text."""
        if not isinstance(value, str):
            raise InvalidRequestError(f"{param} must be a string", param=param)
        return cls(kind, value, param)


def canonical_json(value: Any) -> str:
    """`value` as compact JSON text (the cache key of a schema). Keys keep their order: a
    schema's property order is the order the output writes them in."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
