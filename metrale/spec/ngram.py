"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of a
sequence's own last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`).

Owner: spec. Pure Python. `SequenceIndex` is the incremental per-sequence index (also used by
the suffix proposer); `NgramProposer` adds the copy window and the miss backoff on top.

The index maps, for every n, the rolling hash of an n-gram to the end of its latest
occurrence that ends at least n tokens before the sequence's end: an occurrence becomes
eligible once it cannot overlap the current suffix, and eligibility only grows with the
sequence, so each new token adds one entry per n and no entry ever needs removing.

Invariants:
- A draft is a copy of tokens the sequence already has: `tokens[e : e + m]` where
  `tokens[e - n : e]` equals the last n tokens, `e <= len - n` (the occurrence ends before
  the suffix starts) and `e + m <= len` (never past the known tokens); `m <= max_drafts`.
- Every index hit is re-checked token by token: a hash collision costs a miss (or a shorter
  match), never a wrong draft.
- Indexing is incremental: a call hashes only tokens it has not seen, amortised
  O((max - min + 1) x new tokens); tokens that do not extend what was indexed (a reused
  `seq_id`) are re-indexed from scratch rather than trusted.
- A negative token (the engine's `FED_TOKEN` placeholder) is never indexed or drafted: a
  sequence whose tokens hold one gets no drafts until it is overwritten.
- The copy window stays in 1..k; a miss hold lasts at most `MAX_HOLD` rounds.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from metrale.spec.proposer import DraftRequest, Proposer

#: Longest n-gram any lookup matches.
MAX_NGRAM = 32
#: Most propose rounds a run of misses holds a sequence back.
MAX_HOLD = 64

_MOD = (1 << 61) - 1
_BASE = 0x9E3779B97F4A7C15 % _MOD
_POW = tuple(pow(_BASE, i, _MOD) for i in range(MAX_NGRAM + 1))


def extend_prefix_hashes(prefix: array, tokens: Sequence[int], start: int, stop: int) -> None:
    """Append the prefix hashes of `tokens[start:stop]` to `prefix` (which holds the hashes
    of `tokens[:start]`, `prefix[0] == 0`)."""
    h = prefix[-1]
    for i in range(start, stop):
        h = (h * _BASE + int(tokens[i]) + 1) % _MOD
        prefix.append(h)


def window_hash(prefix: Sequence[int], start: int, end: int) -> int:
    """Hash of `tokens[start:end]` (at most `MAX_NGRAM` long) from the prefix hashes; equal
    windows hash equal wherever they sit. Tests replace it to force collisions."""
    return (prefix[end] - prefix[start] * _POW[end - start]) % _MOD


def same_tokens(a: Sequence[int], a0: int, b: Sequence[int], b0: int, n: int) -> bool:
    """Whether `a[a0 : a0 + n] == b[b0 : b0 + n]`."""
    return all(a[a0 + i] == b[b0 + i] for i in range(n))


class SequenceIndex:
    """One sequence's n-gram index: for each n in [min_n, max_n], hash -> end of the latest
    occurrence that ends at least n tokens before the end (see the module docstring)."""

    __slots__ = ("_last", "max_n", "min_n", "prefix", "tables")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._reset()

    def _reset(self) -> None:
        #: prefix[i] is the hash of the first i tokens; len(prefix) - 1 tokens are indexed.
        self.prefix = array("q", [0])
        self.tables: list[dict[int, int]] = [{} for _ in range(self.max_n - self.min_n + 1)]
        self._last = -1

    @property
    def length(self) -> int:
        """How many tokens are indexed."""
        return len(self.prefix) - 1

    def sync(self, tokens: Sequence[int]) -> bool:
        """Index the tokens not seen yet. False (and nothing indexed past it) when a new token
        is a placeholder: no draft can be aligned to the sequence's end then."""
        old = self.length
        new = len(tokens)
        if old and (new < old or tokens[old - 1] != self._last):
            self._reset()  # not an extension of what was indexed: start over
            old = 0
        if any(tokens[i] < 0 for i in range(old, new)):
            return False
        if new == old:
            return True
        extend_prefix_hashes(self.prefix, tokens, old, new)
        prefix = self.prefix
        for j, n in enumerate(range(self.min_n, self.max_n + 1)):
            table = self.tables[j]
            # Occurrences ending at e become eligible once e <= length - n.
            for e in range(max(n, old - n + 1), new - n + 1):
                table[window_hash(prefix, e - n, e)] = e
        self._last = int(tokens[new - 1])
        return True

    def find(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier, non-overlapping occurrence of
        the longest suffix n-gram that has one; [] when none does. `tokens` are the synced
        tokens."""
        length = self.length
        prefix = self.prefix
        for n in range(min(self.max_n, length // 2), self.min_n - 1, -1):
            e = self.tables[n - self.min_n].get(window_hash(prefix, length - n, length))
            if e is None or e < n or e > length - n:
                continue
            if not same_tokens(tokens, e - n, tokens, length - n, n):
                continue  # a hash collision
            return [int(tokens[i]) for i in range(e, min(e + limit, length))]
        return []


class _SeqState:
    __slots__ = ("hold", "index", "misses", "window")

    def __init__(self, index: SequenceIndex, window: int) -> None:
        self.index = index
        self.window = window
        self.misses = 0
        self.hold = 0


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own tokens (prompt + output).

    Copy window: starts at k, halves (min 1) after a verify that accepted fewer than half its
    drafts, doubles (max k) after a fully accepted one. Miss backoff: after m consecutive
    propose rounds that found no match, the sequence is held for 2^(m-1) rounds (at most
    `MAX_HOLD`). A held round is spent by each `may_propose` that answers False and by each
    `propose` request that arrives while held (it gets no drafts), so an engine that asks
    `may_propose` once per step per row, or one that just sends every row to `propose`, both
    hold a sequence for 2^(m-1) steps.
    """

    name = "ngram"

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max <= MAX_NGRAM:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_NGRAM}, got "
                f"{prompt_lookup_min}..{prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._seqs: dict[str, _SeqState] = {}
        self._own_hits = 0
        self._misses = 0

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self._propose_one(req) for req in requests]

    def _propose_one(self, req: DraftRequest) -> list[int]:
        st = self._seqs.get(req.seq_id)
        if st is None:
            st = self._seqs[req.seq_id] = _SeqState(SequenceIndex(self.min_n, self.max_n), self.k)
        if st.hold > 0:
            st.hold -= 1
            return []
        if req.max_drafts < 1 or not st.index.sync(req.tokens):
            return []
        limit = min(st.window, req.max_drafts)
        drafts = st.index.find(req.tokens, limit)
        if drafts:
            self._own_hits += 1
        else:
            drafts = self._fallback(req, st.index, limit)
        if drafts:
            st.misses = 0
        else:
            self._misses += 1
            st.misses += 1
            st.hold = min(MAX_HOLD, 1 << min(st.misses - 1, 30))
        return drafts

    def _fallback(self, req: DraftRequest, index: SequenceIndex, limit: int) -> list[int]:
        """Drafts from elsewhere when the sequence's own tokens have no match (`index` is
        synced with `req.tokens`); none for plain prompt lookup."""
        return []

    def may_propose(self, seq_id: str) -> bool:
        st = self._seqs.get(seq_id)
        if st is None or st.hold == 0:
            return True
        st.hold -= 1
        return False

    def on_verified(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        st = self._seqs.get(seq_id)
        if st is None or num_drafted < 1:
            return
        if num_accepted >= num_drafted:
            st.window = min(self.k, st.window * 2)
        elif 2 * num_accepted < num_drafted:
            st.window = max(1, st.window // 2)

    def on_finished(self, seq_id: str, tokens: Sequence[int], tenant: str | None) -> None:
        self._seqs.pop(seq_id, None)

    def stats(self) -> dict[str, int]:
        return {"sequences": len(self._seqs), "own_hits": self._own_hits, "misses": self._misses}
