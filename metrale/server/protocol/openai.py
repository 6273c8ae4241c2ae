"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`): their validation, the
sampling-parameter mapping, prompts and chat messages (the pieces of the responses, logprobs
blocks, usage and finish reasons, are `openai_output.py`'s).

Owner: server. Pydantic v2 models validate the bodies; `sampling_params()` maps them onto
`SamplingParams` (which validates ranges and names the offending field).

Invariants:
- Defaults are OpenAI's: `temperature` 1, `top_p` 1, `n` 1; completions `max_tokens` 16,
  chat `max_tokens` unset (up to the context). Except that a field the request leaves unset
  (None) among `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` takes the
  model's generation-config default when it has one (`SamplingDefaults.pick`), as in vLLM.
- Fields that would change the result but are not supported (functions, audio, audio /
  file content parts, `best_of` != n, a `suffix` on a model without fill-in-the-middle
  tokens) are refused with a 400 naming the field. Output constraints (`response_format`,
  `structured_outputs`, `guided_*`) become `SamplingParams.structured_outputs`
  (`metrale.server.structured`); tools, tool choice and reasoning are the chat route's
  `ChatOutputPlan` (`metrale.server.chat_output`).
- Image parts (`image_url`, `image`, `input_image`) and `video_url` parts are kept, in order
  with the text parts, as `{"type": "image_url" | "video_url", ...: {"url": ...}}` for
  `metrale.server.media` (which refuses them on a text-only model, naming the part).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from metrale.errors import InvalidRequestError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import SamplingParams
from metrale.server.protocol.common import SpeculationFields, content_parts, unsupported
from metrale.server.structured import request_grammar
from metrale.server.tools import openai_tool_messages
from metrale.tokenizer.tokenizer import Tokenizer

#: Most choices one request may ask for.
MAX_N = 128


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(SpeculationFields):
    """Fields chat and completions share, OpenAI's plus vLLM's extra sampling fields (and
    the speculation extensions, `speculative` and `tenant`)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names), sent through the SDKs' `extra_body`.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # Output constraints (OpenAI's response_format; vLLM's structured_outputs and guided_*).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    #: vLLM's: the answer carries `prompt_token_ids` and each choice's `token_ids`.
    return_token_ids: bool | None = None
    #: vLLM's: logprob entries name tokens as "token_id:<id>" (exact for any byte split).
    return_tokens_as_token_ids: bool | None = None
    #: vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool | None = None
    #: vLLM's: lower is served first under `--scheduling-policy priority`.
    priority: int = 0

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """`ids` cut to their last `truncate_prompt_tokens` (vLLM's rule)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == 0:
            raise InvalidRequestError(
                "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
            )
        keep = max_model_len - 1 if k == -1 else k
        return ids[-keep:] if len(ids) > keep else ids

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: SamplingDefaults | None = None,
    ) -> SamplingParams:
        """The request's `SamplingParams`: each field as the request set it, else the model's
        default from `defaults` (its generation config), else `SamplingParams`' default."""
        pick = (defaults or SamplingDefaults()).pick

        if self.n > MAX_N:
            raise InvalidRequestError(f"n must be at most {MAX_N}, got {self.n}", param="n")

        return SamplingParams(
            n=self.n,
            temperature=pick("temperature", self.temperature),
            top_p=pick("top_p", self.top_p),
            top_k=pick("top_k", self.top_k),
            min_p=pick("min_p", self.min_p),
            repetition_penalty=pick("repetition_penalty", self.repetition_penalty),
            presence_penalty=pick("presence_penalty", self.presence_penalty),
            frequency_penalty=pick("frequency_penalty", self.frequency_penalty),
            logit_bias=self.logit_bias,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=pick("min_tokens", self.min_tokens),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=pick("ignore_eos", self.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=pick("skip_special_tokens", self.skip_special_tokens),
            include_stop_str_in_output=pick(
                "include_stop_str_in_output", self.include_stop_str_in_output
            ),
            structured_outputs=request_grammar(self),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )


class CompletionRequest(SamplingFields):
    IGNORED: ClassVar[frozenset[str]] = frozenset({"user", "metadata", "service_tier"})

    prompt: Any = Field(default=None)
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        if self.suffix and self.echo:
            raise unsupported("suffix", "echo with a suffix is not implemented")
        if self.suffix and not (
            isinstance(self.prompt, str)
            or (isinstance(self.prompt, list) and all(isinstance(p, str) for p in self.prompt))
        ):
            raise InvalidRequestError(
                "a suffix (fill-in-the-middle) needs a text prompt, not token ids",
                param="suffix",
            )
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", f"best_of must equal n ({self.n}) when given")
        if self.prompt is None:
            raise InvalidRequestError("'prompt' is a required field", param="prompt")


_REFUSED_CHAT_FIELDS = {
    "functions": "function calling",
    "function_call": "function calling",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning controls",
}


class ChatCompletionRequest(SamplingFields):
    IGNORED: ClassVar[frozenset[str]] = frozenset(
        {
            "user",
            "metadata",
            "store",
            "service_tier",
            "prompt_cache_key",
            "safety_identifier",
        }
    )

    messages: list[Any]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    #: vLLM's: the prompt ends inside the final assistant message, which the model continues.
    continue_final_message: bool = False
    #: vLLM's: the answer's content starts with the final message's when that is the
    #: assistant's (what `continue_final_message` continues).
    echo: bool = False
    #: vLLM's per-request template: a template name the tokenizer has, or Jinja source.
    chat_template: str | None = None

    def check_supported(self) -> None:
        for name, what in _REFUSED_CHAT_FIELDS.items():
            value = getattr(self, name)
            if value is not None and value != []:
                raise unsupported(name, f"{what} is not implemented")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise unsupported("modalities", "only text output is implemented")
        reserved = {"messages", "add_generation_prompt", "tools", "chat_template"}
        for key in (self.chat_template_kwargs or {}).keys() & reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set '{key}'", param="chat_template_kwargs"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs needs logprobs set to true", param="top_logprobs"
            )

    @property
    def resolved_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def logprob_count(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


# ----------------------------------------------------------------------------- prompts


def completion_prompts(
    prompt: Any, tokenizer: Tokenizer, add_special_tokens: bool = True
) -> list[tuple[str | None, list[int]]]:
    """`prompt` (a string, strings, token ids, or lists of token ids) as (text, ids) pairs;
    text is encoded with `add_special_tokens` (vLLM's field, true by default)."""

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"prompt {why}", param="prompt")

    def is_token(t: Any) -> bool:
        return isinstance(t, int) and not isinstance(t, bool)

    if isinstance(prompt, str):
        return [(prompt, tokenizer.encode(prompt, add_special_tokens))]
    if not isinstance(prompt, list) or not prompt:
        raise bad("must be a string, a list of strings, token ids or lists of token ids")
    if all(is_token(t) for t in prompt):
        return [(None, list(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [(p, tokenizer.encode(p, add_special_tokens)) for p in prompt]
    if all(isinstance(p, list) and p and all(is_token(t) for t in p) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise bad("must be a string, a list of strings, token ids or non-empty lists of token ids")


#: Image parts, kept as they are for the vision model (`metrale.server.media`).
IMAGE_PARTS = ("image_url", "image", "input_image")

_UNSUPPORTED_PARTS = {
    "input_audio": "audio input",
    "file": "file input",
}


def _image_part(part: dict[str, Any], at: str) -> dict[str, Any]:
    """An image part as `{"type": "image_url", "image_url": {"url": ...}}`."""
    value = part.get("image_url", part.get("image"))
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{at} needs an image URL (image_url.url)", param=at)
    return {"type": "image_url", "image_url": {"url": url}}


def _video_part(part: dict[str, Any], at: str) -> dict[str, Any]:
    """A `video_url` part (a GIF's URL) as `{"type": "video_url", "video_url": {"url": ...}}`."""
    value = part.get("video_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{at} needs a video URL (video_url.url)", param=at)
    return {"type": "video_url", "video_url": {"url": url}}


def _other_part(kind: str | None, part: Any, at: str) -> dict[str, Any]:
    """A chat message's content part that is not text: an image or a video, else refused."""
    if kind in IMAGE_PARTS:
        return _image_part(part, at)
    if kind == "video_url":
        return _video_part(part, at)
    if kind in _UNSUPPORTED_PARTS:
        raise unsupported(at, f"{_UNSUPPORTED_PARTS[kind]} is not implemented")
    raise InvalidRequestError(f"{at} must be a text part {{'type': 'text', 'text': ...}}", param=at)


def chat_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the plain `{role, content: str}` dicts chat templates read;
    a content list with image parts stays a list (text parts and image parts in order)."""
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    result: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role == "function":
            raise unsupported(f"{where}.role", "'function' messages (use 'tool')")
        if role not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(
                f"{where}.role must be one of system, developer, user, assistant, tool; "
                f"got {role!r}",
                param=f"{where}.role",
            )
        if message.get("function_call"):
            raise unsupported(f"{where}.function_call", "use tool_calls")
        content = message.get("content")
        if content is None:
            if role != "assistant":
                raise InvalidRequestError(f"{where}.content is required", param=f"{where}.content")
            content = ""
        elif isinstance(content, list):
            content = content_parts(content, f"{where}.content", _other_part, "\n")
        elif not isinstance(content, str):
            raise InvalidRequestError(
                f"{where}.content must be a string or a list of text parts",
                param=f"{where}.content",
            )
        result.append(
            {"role": role, "content": content, **openai_tool_messages(message, role, where)}
        )
    return result
