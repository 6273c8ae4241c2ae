"""Request-body parsing shared by the OpenAI and Anthropic protocols.

Owner: server. `parse_body` validates a JSON body against a pydantic v2 model and turns every
failure into an `InvalidRequestError` whose `param` names the offending field;
`content_parts` walks a message's content list (OpenAI parts, Anthropic blocks), each API
saying which other kinds it keeps or refuses.

Invariants:
- A field the server does not know is, by default, ignored as vLLM ignores it: `parse_body`
  hands its name to the caller's `on_unknown` (which logs a warning and counts it). Under
  `--strict-request-fields` (`on_unknown` None) it is refused with a 400 naming it, as OpenAI
  answers unknown arguments. Fields that would change the result and are not supported yet
  are refused by name in either mode, never silently ignored.
- Fields listed as `IGNORED` are accepted and have no effect (they do not change the output:
  `user`, `metadata`, ...).
- Every generation body (completions, chat, messages) takes `SpeculationFields`: `speculative`
  is a JSON boolean (anything else is a 400 naming it), `tenant`, `cache_salt` (vLLM's) and
  `session_id` non-empty strings of at most `MAX_TENANT_LEN` characters. `session_id` (or the
  OpenAI `user`) only steers which SSM snapshots a hybrid model keeps, never the output.
- `decode_json` refuses, with a 400 naming the problem (and the field where there is one),
  before any model sees the body: invalid JSON or UTF-8, `NaN` / `Infinity`, containers nested
  deeper than `MAX_JSON_DEPTH`, integers of more than `MAX_INT_DIGITS` digits, and any string
  or key holding a lone surrogate (`"\\ud800"`): such text is refused, never replaced. What it
  returns is plain JSON data whose text always encodes as UTF-8.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from metrale.errors import InvalidRequestError, Unsupported

ModelT = TypeVar("ModelT", bound="RequestModel")

#: Longest explicit `tenant` a request may name.
MAX_TENANT_LEN = 256
#: Deepest nesting of arrays and objects a body may have (the top-level object is 1).
MAX_JSON_DEPTH = 64
#: Most digits of one JSON integer (a signed 64-bit integer has at most 19).
MAX_INT_DIGITS = 20
#: Raw bytes that may decode to a surrogate: a `\\uD800`..`\\uDFFF` escape, or the UTF-8-style
#: encoding of one (which `json.loads` lets through); only bodies holding one are walked.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestModel(BaseModel):
    """Base of request bodies: unknown fields are kept so they can be named in the refusal."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    #: Accepted and without effect on the output.
    IGNORED: ClassVar[frozenset[str]] = frozenset()

    def unknown_fields(self) -> list[str]:
        """Fields of the body that no one defines (neither declared nor `IGNORED`)."""
        return [name for name in self.model_extra or {} if name not in self.IGNORED]


class SpeculationFields(RequestModel):
    """Speculative decoding's per-request extension fields (vLLM-style; the OpenAI SDKs send
    them through `extra_body`). Neither changes what a request's tokens are drawn from:
    verification is lossless, so they only steer speed and which requests' tokens may be
    drafted from."""

    #: False: this request never speculates (no drafts are proposed or verified for it).
    speculative: StrictBool = True
    #: Subdivides the request's draft-lookup tenant (see `metrale.server.auth.lookup_tenant`).
    tenant: str | None = Field(default=None, max_length=MAX_TENANT_LEN)
    #: vLLM's `cache_salt`: requests with different salts (or none) never share prefix-cache
    #: blocks, so a cache hit's timing tells nothing across them.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_TENANT_LEN)
    #: The conversation a request continues (hybrid models keep its SSM snapshots cached);
    #: without it, the body's `user`, else the prompt's opening tokens, name the session.
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_TENANT_LEN)

    def session(self) -> str | None:
        """The request's session for the SSM snapshot store: `session_id`, else `user`."""
        if self.session_id:
            return self.session_id
        user = (self.model_extra or {}).get("user")
        return f"user:{user}" if isinstance(user, str) and user else None


def content_parts(
    content: list[Any],
    where: str,
    other: Callable[[str | None, Any, str], dict[str, Any] | None],
    sep: str,
) -> str | list[dict[str, Any]]:
    """A message's content list (OpenAI parts, Anthropic blocks): its text parts joined by
    `sep` when all it keeps is text, else the text parts and the kept others in order. A
    part that is not `{'type': 'text', 'text': str}` goes to `other(kind, part, at)` (`at`:
    its parameter path), which returns the part to keep, None to skip it, or raises."""
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        else:
            kept = other(kind, part, at)
            if kept is not None:
                parts.append(kept)
    return sep.join(texts) if len(parts) == len(texts) else parts


def unsupported(field: str, what: str | None = None) -> Unsupported:
    return Unsupported(
        f"'{field}' is not supported by this server yet" + (f": {what}" if what else ""),
        param=field,
    )


class _HugeInt:
    """An integer literal past `MAX_INT_DIGITS`, kept as text until its field is known."""

    def __init__(self, digits: str) -> None:
        self.digits = digits


class _BadConstant(Exception):
    pass


def _parse_constant(name: str) -> Any:
    raise _BadConstant(name)


def decode_json(raw: bytes) -> Any:
    """The body as JSON data, or an `InvalidRequestError` naming what is wrong with it (see
    the module invariants). Its cost is linear in the body; callers run large bodies off the
    event loop."""
    if not raw:
        raise InvalidRequestError("the request body is empty; expected a JSON object", param=None)
    huge: list[bool] = []

    def parse_int(text: str) -> int | _HugeInt:
        if len(text) - text.startswith("-") > MAX_INT_DIGITS:
            huge.append(True)
            return _HugeInt(text)
        return int(text)

    try:
        value = json.loads(raw, parse_int=parse_int, parse_constant=_parse_constant)
    except RecursionError:
        raise InvalidRequestError(
            "the request body nests arrays or objects too deeply (more than "
            f"{MAX_JSON_DEPTH} levels are refused)"
        ) from None
    except _BadConstant as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON: {exc} is not a JSON value"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    nested = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    text = _MAYBE_SURROGATE.search(raw) is not None
    if nested or text or huge:
        _check_tree(value, text_check=text)
    return value


#: A path into the body as a linked list, (parent, key), built per node without copying.
_Path = tuple[Any, str | int] | None


def _path(path: _Path) -> str | None:
    parts: list[str | int] = []
    while path is not None:
        path, key = path
        parts.append(key)
    return _loc_to_param(tuple(reversed(parts)))


def _check_tree(value: Any, *, text_check: bool) -> None:
    """Walk the decoded body (iteratively: a deep body cannot overflow the stack) for the
    limits `json.loads` does not enforce."""
    stack: list[tuple[Any, _Path, int]] = [(value, None, 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, (dict, list)):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                top = path  # named by its top-level field: the full path is as deep
                while top is not None and top[0] is not None:
                    top = top[0]
                where = _path(top)
                raise InvalidRequestError(
                    f"'{where or 'the request body'}' nests arrays or objects more than "
                    f"{MAX_JSON_DEPTH} levels deep",
                    param=where,
                )
            if isinstance(node, dict):
                for key, item in node.items():
                    if text_check and _SURROGATE.search(key):
                        raise _surrogate_error(path, "a key")
                    stack.append((item, (path, key), depth))
            else:
                for i, item in enumerate(node):
                    stack.append((item, (path, i), depth))
        elif isinstance(node, _HugeInt):
            where = _path(path)
            raise InvalidRequestError(
                f"invalid value for '{where or 'the request body'}': an integer of "
                f"{len(node.digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS} are accepted)",
                param=where,
            )
        elif text_check and isinstance(node, str) and _SURROGATE.search(node):
            raise _surrogate_error(path, "the text")


def _surrogate_error(path: _Path, what: str) -> InvalidRequestError:
    where = _path(path)
    return InvalidRequestError(
        f"invalid value for '{where or 'the request body'}': {what} holds a lone UTF-16 "
        "surrogate (such as \\ud800), which is not valid Unicode; it is refused, not replaced",
        param=where,
    )


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str):
            # pydantic reports union branches and function validators in the location
            if item.startswith(("function-", "tagged-union", "list[", "dict[")) or item in {
                "str",
                "int",
                "float",
                "bool",
                "none",
            }:
                continue
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def parse_body(
    model: type[ModelT],
    body: Any,
    on_unknown: Callable[[list[str]], None] | None = None,
) -> ModelT:
    """`body` validated as `model`. Unknown fields go to `on_unknown`; without one, the first
    is refused with a 400 naming it (the strict policy)."""
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"the request body must be a JSON object, got {type(body).__name__}"
        )
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _loc_to_param(tuple(first.get("loc", ())))
        msg = str(first.get("msg", "invalid value"))
        if first.get("type") == "missing":
            raise InvalidRequestError(f"'{param}' is a required field", param=param) from None
        raise InvalidRequestError(
            f"invalid value for '{param}': {msg}" if param else msg, param=param
        ) from None
    unknown = parsed.unknown_fields()
    if unknown:
        if on_unknown is None:
            raise InvalidRequestError(
                f"unrecognized request argument: {unknown[0]}", param=unknown[0]
            )
        on_unknown(unknown)
    return parsed
