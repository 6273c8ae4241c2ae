"""Structured-output request fields of every API, mapped onto one `GrammarSpec`.

Owner: server. OpenAI `response_format` (`text`, `json_object`, `json_schema`,
`structural_tag`), vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
`json_object`, `structural_tag`) and its older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` fields, and Anthropic's `output_config.format`
(`{"type": "json_schema", "schema": ...}`). The engine compiles the spec; a construct xgrammar
refuses comes back as a 400 naming the field and the construct.

Invariants:
- At most one constraint per request: two fields that both constrain (say `response_format`
  json_schema and `guided_regex`) are a 400 naming the second.
- `response_format` `{"type": "text"}` constrains nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from metrale.errors import InvalidRequestError
from metrale.sampling.structured import GrammarSpec

__all__ = ["anthropic_output_format", "request_grammar", "responses_text_format"]


def _typed_format(
    value: Any, param: str, kinds: dict[str, Callable[[dict[str, Any]], GrammarSpec]]
) -> GrammarSpec | None:
    """A `{"type": ...}` format object (OpenAI `response_format`, Responses `text.format`):
    None and `text` constrain nothing, `json_object` is any JSON object, and every other type
    is `kinds[type](value)`; an unknown type is a 400 naming the ones this field takes."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", param)
    if kind in kinds:
        return kinds[kind](value)
    names = ["text", "json_object", *kinds]
    raise InvalidRequestError(
        f"{param}.type must be {', '.join(names[:-1])} or {names[-1]}; got {kind!r}",
        param=param,
    )


def _response_format(value: Any) -> GrammarSpec | None:
    param = "response_format"

    def json_schema(fmt: dict[str, Any]) -> GrammarSpec:
        body = fmt.get("json_schema")
        if not isinstance(body, dict):
            raise InvalidRequestError(
                f"{param}.json_schema must be an object with a 'schema'", param=param
            )
        schema = body.get("schema", body.get("json_schema"))
        if schema is None:
            raise InvalidRequestError(f"{param}.json_schema.schema is required", param=param)
        return GrammarSpec.json_schema(schema, param)

    return _typed_format(
        value,
        param,
        {"json_schema": json_schema, "structural_tag": lambda fmt: _structural_tag(fmt, param)},
    )


def _structural_tag(value: Any, param: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param}: not valid JSON ({exc})", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be a structural tag object", param=param)
    if "format" not in value:
        raise InvalidRequestError(
            f"{param}: a structural tag needs 'format' (xgrammar's structural tag)", param=param
        )
    body = {"type": "structural_tag", "format": value["format"]}
    return GrammarSpec("structural_tag", json.dumps(body, ensure_ascii=False), param)


def _structured_outputs(value: Any) -> GrammarSpec | None:
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be an object", param=param)
    found: list[GrammarSpec] = []
    for key, item in value.items():
        if item is None or item is False:
            continue
        at = f"{param}.{key}"
        if key == "json":
            found.append(GrammarSpec.json_schema(item, at))
        elif key == "json_object":
            found.append(GrammarSpec("json_object", "", at))
        elif key == "regex":
            found.append(GrammarSpec.text("regex", item, at))
        elif key == "choice":
            found.append(GrammarSpec.choice(item, at))
        elif key == "grammar":
            found.append(GrammarSpec.text("grammar", item, at))
        elif key == "structural_tag":
            found.append(_structural_tag(item, at))
        elif key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            continue  # no effect here: one backend, compact JSON, the schema's own rules
        elif key == "backend" and item in ("auto", "xgrammar"):
            continue
        elif key in ("backend", "whitespace_pattern"):
            raise InvalidRequestError(
                f"{at} is not supported: the backend is xgrammar, JSON is written compactly",
                param=at,
            )
        else:
            raise InvalidRequestError(f"{param} has no field {key!r}", param=at)
    if len(found) > 1:
        raise InvalidRequestError(f"{param} may set only one constraint", param=param)
    return found[0] if found else None


def request_grammar(body: Any) -> GrammarSpec | None:
    """The one constraint a completions or chat body asks for (or None); see the module."""
    specs: list[GrammarSpec] = []
    extra = getattr(body, "model_extra", None) or {}

    def field(name: str) -> Any:
        return getattr(body, name, None) if hasattr(body, name) else extra.get(name)

    for spec in (
        _response_format(field("response_format")),
        _structured_outputs(field("structured_outputs")),
        None if field("guided_json") is None
        else GrammarSpec.json_schema(field("guided_json"), "guided_json"),
        None if field("guided_regex") is None
        else GrammarSpec.text("regex", field("guided_regex"), "guided_regex"),
        None if field("guided_choice") is None
        else GrammarSpec.choice(field("guided_choice"), "guided_choice"),
        None if field("guided_grammar") is None
        else GrammarSpec.text("grammar", field("guided_grammar"), "guided_grammar"),
    ):  # fmt: skip
        if spec is not None:
            specs.append(spec)
    if len(specs) > 1:
        raise InvalidRequestError(
            f"{specs[1].param}: only one output constraint per request "
            f"({specs[0].param} is set too)",
            param=specs[1].param,
        )
    return specs[0] if specs else None


def anthropic_output_format(output_config: Any) -> GrammarSpec | None:
    """Anthropic `output_config.format`: `{"type": "json_schema", "schema": {...}}`."""
    param = "output_config.format"
    if not isinstance(output_config, dict) or output_config.get("format") is None:
        return None
    fmt = output_config["format"]
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequestError(
            f"{param} must be {{'type': 'json_schema', 'schema': ...}}", param=param
        )
    if "schema" not in fmt:
        raise InvalidRequestError(f"{param}.schema is required", param=param)
    return GrammarSpec.json_schema(fmt["schema"], param)


def responses_text_format(text: Any) -> GrammarSpec | None:
    """Responses `text.format`: `text`, `json_object`, or `{"type": "json_schema", "name",
    "schema", "strict"}`."""
    param = "text.format"

    def json_schema(fmt: dict[str, Any]) -> GrammarSpec:
        if "schema" not in fmt:
            raise InvalidRequestError(f"{param}.schema is required", param=param)
        return GrammarSpec.json_schema(fmt["schema"], param)

    fmt = text.get("format") if isinstance(text, dict) else None
    return _typed_format(fmt, param, {"json_schema": json_schema})
