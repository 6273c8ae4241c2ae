"""Request-body parsing shared by the OpenAI and Anthropic protocols.

Owner: server. `parse_body` validates a JSON body against a pydantic v2 model and turns every
failure into an `InvalidRequestError` whose `param` names the offending field.

Invariants:
- A field the server does not know is refused with a 400 naming it (OpenAI answers unknown
  arguments the same way); fields that would change the result and are not supported yet
  (tools, response_format, images, ...) are refused by name, never silently ignored.
- Fields listed as `IGNORED` are accepted and have no effect (they do not change the output:
  `user`, `metadata`, ...).
- Every generation body (completions, chat, messages) takes `SpeculationFields`: `speculative`
  is a JSON boolean (anything else is a 400 naming it), `tenant` a string of at most
  `MAX_TENANT_LEN` characters.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from metrale.errors import InvalidRequestError, Unsupported

ModelT = TypeVar("ModelT", bound="RequestModel")

#: Longest explicit `tenant` a request may name.
MAX_TENANT_LEN = 256


class RequestModel(BaseModel):
    """Base of request bodies: unknown fields are kept so they can be named in the refusal."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    #: Accepted and without effect on the output.
    IGNORED: ClassVar[frozenset[str]] = frozenset()

    def check_extra_fields(self) -> None:
        for name in self.model_extra or {}:
            if name in self.IGNORED:
                continue
            raise InvalidRequestError(f"unrecognized request argument: {name}", param=name)


class SpeculationFields(RequestModel):
    """Speculative decoding's per-request extension fields (vLLM-style; the OpenAI SDKs send
    them through `extra_body`). Neither changes what a request's tokens are drawn from:
    verification is lossless, so they only steer speed and which requests' tokens may be
    drafted from."""

    #: False: this request never speculates (no drafts are proposed or verified for it).
    speculative: StrictBool = True
    #: Subdivides the request's draft-lookup tenant (see `metrale.server.auth.lookup_tenant`).
    tenant: str | None = Field(default=None, max_length=MAX_TENANT_LEN)


def unsupported(field: str, what: str | None = None) -> Unsupported:
    return Unsupported(
        f"'{field}' is not supported by this server yet" + (f": {what}" if what else ""),
        param=field,
    )


def decode_json(raw: bytes) -> Any:
    if not raw:
        raise InvalidRequestError("the request body is empty; expected a JSON object", param=None)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


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


def parse_body(model: type[ModelT], body: Any) -> ModelT:
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
    parsed.check_extra_fields()
    return parsed
