"""Stop strings on streamed output text: what may be emitted now, and where the output stops.

Owner: tokenizer package. The engine keeps one `StopStringMatcher` per output sequence with
stop strings and feeds it every detokenized delta, in order.

Invariants:
- Emitted text is never retracted: text that could still be the start of a stop string is held
  back (at most `max(len(stop)) - 1` characters, and only while it is a prefix of some stop
  string); once a partial match fails, the held text is released with the next delta.
- The output stops at the stop string that is complete first in the text, i.e. the one whose
  match ends earliest; of matches ending at the same place, the one starting earliest (the
  longer) wins. This is what a character-by-character stream would see, so the result does not
  depend on how the text was split into deltas.
- On a stop, exactly the text before the stop string is emitted (through it with
  `include_stop_str_in_output`); nothing after it ever is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)


class StopStringMatcher:
    """Finds stop strings across deltas and decides which text is safe to emit."""

    def __init__(self, stops: Iterable[str], include_stop_str_in_output: bool = False) -> None:
        given = list(stops)
        unique = list(dict.fromkeys(s for s in given if s))
        if len(unique) != len(given):
            logger.debug("stop strings %r: empty strings and duplicates dropped", given)
        self._stops: tuple[str, ...] = tuple(unique)
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self._stop_reason: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def stopped(self) -> bool:
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_reason

    @property
    def held_text(self) -> str:
        """Text received but not yet emitted because it may begin a stop string."""
        return self._held

    def process(self, new_text: str) -> tuple[str, bool]:
        """Take the next delta; return (text safe to emit now, whether the output stopped)."""
        if self._stop_reason is not None:
            return "", True
        if not self._stops:
            return new_text, False
        buf = self._held + new_text
        # The held text holds no complete stop string, so every match involves new_text; for
        # each stop its first occurrence is its earliest-ending one.
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is not None:
            end, start, stop = best
            self._stop_reason = stop
            self._held = ""
            return buf[: end if self._include else start], True
        keep = self._partial_match_length(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held text at the natural end of the output ("" after a stop)."""
        held, self._held = self._held, ""
        return "" if self._stop_reason is not None else held

    def _partial_match_length(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for length in range(min(self._max_hold, len(buf)), 0, -1):
            suffix = buf[len(buf) - length :]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
