"""Checking a request before it is queued: its prompt (text or token ids) and its output
budget against the vocabulary and the context; and which checkpoint directory serves (a directory, a repo id in the local Hugging
Face cache, or the bundled model).

Owner: engine (`Engine.check_prompt` and `Engine.add_request` call `check_request`; the
offline `LLM` checks every prompt of a call through `Engine.check_prompt` before queueing any).

Invariants:
- The one home of the context-length rule for requests: a prompt must leave room for at
  least one output token, and `max_tokens` (None: all the room left) must fit
  `max_model_len`; a violation is a `ContextLengthError` naming `prompt` or `max_tokens`.
- Nothing here changes any state: a bad request raises before anything is queued.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from metrale.errors import ContextLengthError, InvalidRequestError
from metrale.sampling.params import SamplingParams
from metrale.tokenizer.tokenizer import Tokenizer

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-code"
BUNDLED_MODEL_NAME = "metrale-tiny-code"
#: The cross-request draft lookup's tenant of requests that name none (offline `LLM` calls,
#: a server without API keys): they share one index.
DEFAULT_TENANT = "default"


def resolve_model_dir(model: str | None) -> str:
    """The checkpoint directory to serve: `model` (a directory, or a Hugging Face repo id
    found in the local cache: `hub_cache_dir`), else the bundled model. Nothing is
    downloaded: a repo id that is not in the cache is an error saying so."""
    if model is not None:
        if Path(model).exists() or not _REPO_ID.fullmatch(model):
            return model
        found = hub_cache_dir(model)
        if found is None:
            raise InvalidRequestError(
                f"model {model!r} is not a directory, and the local Hugging Face cache "
                f"({_hub_cache_root()}) has no snapshot of it; metrale downloads nothing: "
                f"fetch it first (`huggingface-cli download {model}`) or pass a directory",
                param="model",
            )
        return str(found)
    if not (BUNDLED_MODEL_DIR / "config.json").is_file():
        raise InvalidRequestError(
            f"no model given and the bundled model is missing at {BUNDLED_MODEL_DIR}", param="model"
        )
    return str(BUNDLED_MODEL_DIR)


#: A Hugging Face repo id: `org/name` (letters, digits, `-_.`).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _hub_cache_root() -> Path:
    """Where Hugging Face keeps downloaded repos: `$HF_HUB_CACHE`, else `$HF_HOME/hub`,
    else `~/.cache/huggingface/hub` (the library's own rule)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home) / "hub"


def hub_cache_dir(repo_id: str) -> Path | None:
    """The cached snapshot of `repo_id` holding a config.json: the one `refs/main` names,
    else the newest; None when the cache has none."""
    repo = _hub_cache_root() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        named = snapshots / ref.read_text().strip()
        if (named / "config.json").is_file():
            return named
    candidates = [d for d in snapshots.iterdir() if (d / "config.json").is_file()]
    return max(candidates, key=lambda d: d.stat().st_mtime) if candidates else None


def check_request(
    prompt: str | Sequence[int] | None,
    prompt_token_ids: Sequence[int] | None,
    params: SamplingParams,
    tokenizer: Tokenizer,
    vocab_size: int,
    max_model_len: int,
) -> tuple[str | None, list[int], int]:
    """(prompt text or None, prompt token ids, resolved output budget), or a clear error."""
    text, ids = _prompt_ids(prompt, prompt_token_ids, tokenizer)
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"prompt token id {t!r} is outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )
    if len(ids) >= max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens, but the "
            f"prompt has {len(ids)} tokens, leaving no room for output",
            param="prompt",
        )
    params.validate_for_vocab(vocab_size)
    return text, ids, _resolve_max_tokens(len(ids), params, max_model_len)


def bad_word_ids(params: SamplingParams, tokenizer: Tokenizer) -> list[list[int]]:
    """`params.bad_words` as the token-id sequences that spell them, each with and without a
    leading space (how a word mid-sentence and at the start tokenize), without repeats."""
    seen: list[list[int]] = []
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in seen:
                seen.append(ids)
    return seen


def _prompt_ids(
    prompt: str | Sequence[int] | None,
    prompt_token_ids: Sequence[int] | None,
    tokenizer: Tokenizer,
) -> tuple[str | None, list[int]]:
    """The prompt's text (None when given as ids) and token ids, refused when absent or
    empty; `check_request` checks them against the vocabulary and the context."""
    if prompt_token_ids is not None:
        text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
    elif isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        text, ids = prompt, tokenizer.encode(prompt)
    elif prompt is None:
        raise InvalidRequestError("a prompt (text or token ids) is required", param="prompt")
    else:
        text, ids = None, list(prompt)
    if not ids:
        raise InvalidRequestError("prompt is empty (no tokens)", param="prompt")
    return text, ids


def _resolve_max_tokens(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if params.max_tokens is None:
        return room
    if params.max_tokens > room:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens; the "
            f"prompt has {prompt_len} and max_tokens asks for {params.max_tokens} more",
            param="max_tokens",
        )
    return params.max_tokens
