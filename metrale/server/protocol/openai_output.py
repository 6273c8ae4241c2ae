"""The pieces of OpenAI responses: `usage`, finish reasons, and the logprobs blocks of
completions (`CompletionLogprobs`, echoed prompts merged in) and chat (`chat_logprobs_content`,
with each token's bytes), prompt logprobs included.

Owner: server. Invariants:
- `usage` always carries `prompt_tokens_details.cached_tokens` (0 when nothing was reused).
- Finish reasons: "stop", "length", and "timeout" (a request past its deadline; never
  reported as "length"); "abort" only if the engine ended a request on its own.
- Logprob values are finite in JSON (-inf becomes -9999.0, as vLLM reports it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from metrale.engine.request import Logprob, PositionLogprobs
from metrale.tokenizer.tokenizer import Tokenizer

#: How a -inf logprob is written (JSON has no infinity).
#: How a -inf logprob is written (JSON has no infinity; vLLM's value).
MIN_LOGPROB = -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI clients see it (see the module invariants)."""
    if reason in (None, "stop", "length", "timeout", "abort"):
        return reason
    return "stop"


def finite(logprob: float) -> float:
    if math.isnan(logprob):
        return MIN_LOGPROB
    return max(logprob, MIN_LOGPROB)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: a visible character -> the byte it stands for."""
    visible = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(visible)
    extra = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars)}


def token_bytes(tokenizer: Tokenizer, token_id: int, piece: str) -> list[int]:
    """The UTF-8 bytes a token stands for (exact for byte-level BPE partial characters)."""
    if "\ufffd" in piece:
        raw = tokenizer.id_to_token(token_id)
        table = _byte_decoder()
        if raw is not None and all(ch in table for ch in raw):
            return [table[ch] for ch in raw]
    return list(piece.encode("utf-8"))


def _piece(tokenizer: Tokenizer, token_id: int, entry: Logprob, as_id: bool = False) -> str:
    """How a logprob entry names its token: its text, or "token_id:<id>" with vLLM's
    `return_tokens_as_token_ids`."""
    if as_id:
        return f"token_id:{token_id}"
    if entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def prompt_logprobs_json(
    tokenizer: Tokenizer,
    positions: Sequence[PositionLogprobs | None] | None,
    as_ids: bool = False,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (the first has none: null), a map from
    each reported token id to its `logprob`, `rank` and `decoded_token`."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(tid): {
                "logprob": finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": _piece(tokenizer, tid, lp, as_ids),
            }
            for tid, lp in position.items()
        }
        for position in positions
    ]


def _ranked(position: PositionLogprobs, count: int) -> list[tuple[int, Logprob]]:
    """The top `count` alternatives of a position, by rank (the chosen token if among them)."""
    ranked = sorted(
        ((tid, lp) for tid, lp in position.items() if lp.rank is not None and lp.rank <= count),
        key=lambda item: item[1].rank or 0,
    )
    return ranked[:count]


def chat_logprobs_content(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    top_count: int,
    as_ids: bool = False,
) -> list[dict[str, Any]]:
    content = []
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id) or Logprob(MIN_LOGPROB)
        piece = _piece(tokenizer, token_id, entry, as_ids)
        content.append(
            {
                "token": piece,
                "logprob": finite(entry.logprob),
                "bytes": token_bytes(tokenizer, token_id, piece),
                "top_logprobs": [
                    {
                        "token": (alt := _piece(tokenizer, tid, lp, as_ids)),
                        "logprob": finite(lp.logprob),
                        "bytes": token_bytes(tokenizer, tid, alt),
                    }
                    for tid, lp in _ranked(position, top_count)
                ],
            }
        )
    return content


class CompletionLogprobs:
    """Builds the legacy completions `logprobs` block (four parallel arrays) incrementally."""

    def __init__(
        self, tokenizer: Tokenizer, top_count: int, text_offset: int = 0, as_ids: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.top_count = top_count
        self.offset = text_offset
        self.as_ids = as_ids

    def block(
        self,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None],
    ) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, position in zip(token_ids, positions):
            if position is None:  # the first prompt token has no score
                piece = _piece(self.tokenizer, token_id, Logprob(MIN_LOGPROB), self.as_ids)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                entry = position.get(token_id) or Logprob(MIN_LOGPROB)
                piece = _piece(self.tokenizer, token_id, entry, self.as_ids)
                token_logprobs.append(finite(entry.logprob))
                top: dict[str, float] = {}
                for tid, lp in _ranked(position, self.top_count):
                    top.setdefault(_piece(self.tokenizer, tid, lp, self.as_ids), finite(lp.logprob))
                top.setdefault(piece, finite(entry.logprob))
                top_logprobs.append(top)
            tokens.append(piece)
            text_offset.append(self.offset)
            self.offset += len(piece)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


def merge_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: [*first[key], *second[key]] for key in first}
