"""Chat template rendering with jinja2, compatible with Hugging Face `apply_chat_template`.

Owner: tokenizer package. `Tokenizer.apply_chat_template` is the only caller in the library; it
keeps one `ChatTemplateRenderer` per tokenizer, so compiled templates live and die with it.

Invariants:
- Templates run in jinja2's `ImmutableSandboxedEnvironment` with the settings and helpers HF
  gives them: `trim_blocks`, `lstrip_blocks`, loop controls, the `{% generation %}` block
  (rendered as its body), `raise_exception`, `strftime_now` and an HF-style `tojson` filter. A
  template that renders under HF renders to the same string here.
- Each distinct template source is compiled once per renderer (no process-wide cache); the
  cache holds at most `MAX_COMPILED_TEMPLATES`, least recently used out first, so templates
  sent with requests cannot grow it without bound.
- A template's own `raise_exception(...)` and errors caused by the request's messages surface
  as `InvalidRequestError(param="messages")`; a template that does not compile is the model's
  (or the operator's) fault and surfaces as `CheckpointError` naming where it came from.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from metrale.errors import CheckpointError, InvalidRequestError, MetraleError

logger = logging.getLogger(__name__)

MAX_COMPILED_TEMPLATES = 32


class _TemplateRaisedError(Exception):
    """Carries a template's `raise_exception` message out of jinja2 untouched."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaisedError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF overrides jinja's tojson, which would HTML-escape <, >, & and ' in tool schemas.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape of a (non-empty) conversation and drop keys whose value is None, as HF does.

    OpenAI clients send `content: null` next to `tool_calls`; templates handle a missing key
    but would render a literal "None".
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of message objects", param="messages")
    normalized: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with 'role' and 'content', got "
                f"{type(message).__name__}",
                param="messages",
            )
        normalized.append({k: v for k, v in message.items() if v is not None})
    if not normalized:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    return normalized


class ChatTemplateRenderer:
    """Compiles chat templates once and renders conversations with them."""

    def __init__(self) -> None:
        self._env = _make_environment()
        self._compiled: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, source: str, origin: str) -> jinja2.Template:
        """The compiled form of `source`; `origin` names where it came from, for errors."""
        with self._lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return template
        try:
            template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise CheckpointError(
                f"chat template from {origin} does not compile: {exc.message} "
                f"(template line {exc.lineno})"
            ) from exc
        with self._lock:
            self._compiled[source] = template
            while len(self._compiled) > MAX_COMPILED_TEMPLATES:
                self._compiled.popitem(last=False)
        return template

    def render(
        self,
        source: str,
        origin: str,
        messages: Any,
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        variables: Mapping[str, Any],
    ) -> str:
        """Render `messages` with the template `source`.

        `variables` are the special tokens and the caller's extra keyword arguments; a name
        there overrides `tools`/`documents`/the special tokens, but never `messages` or
        `add_generation_prompt`.
        """
        template = self.compile(source, origin)
        context: dict[str, Any] = {"tools": tools, "documents": None}
        context.update(variables)
        context["messages"] = normalize_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return template.render(**context)
        except _TemplateRaisedError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc
        except jinja2.exceptions.SecurityError as exc:
            raise InvalidRequestError(
                f"chat template from {origin} attempted an unsafe operation: {exc}",
                param="messages",
            ) from exc
        except MetraleError:
            raise
        except Exception as exc:  # whatever a template does wrong with these messages
            logger.debug("chat template from %s failed to render", origin, exc_info=True)
            raise InvalidRequestError(
                f"chat template from {origin} cannot render these messages: "
                f"{type(exc).__name__}: {exc}",
                param="messages",
            ) from exc
