"""The draft proposer interface: propose up to k tokens for a batch of rows; observe what
was accepted.

Owner: spec. Every proposer (n-gram prompt lookup, the shared suffix lookup, the MTP head, the
draft model) implements `Proposer`; the engine is its only caller. The model-backed ones live
in `metrale/engine/` (they need torch and the model); this package stays torch-free.

Invariants:
- `propose` never returns more than `DraftRequest.max_drafts` tokens for a row, and never a
  token outside the vocabulary it was given (token ids it has seen).
- A proposer never sees the tokens of a request whose `tenant` differs from the caller's:
  cross-request state is partitioned by tenant; `tenant=None` keeps a sequence out of every
  cross-request index (it neither feeds nor reads one).
- Per-sequence state is dropped by `on_finished`; a proposer holds nothing for a sequence
  after it (bounded memory).
- `tokens` only ever grow for a given `seq_id` between calls (drafts are never part of
  them: only committed tokens are), so incremental indexes stay valid.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class DraftRequest:
    """One row that may speculate this step."""

    #: The scheduler's sequence id (stable across steps and preemptions).
    seq_id: str
    #: Every committed token of the sequence: prompt, then output; the last is the newest.
    tokens: Sequence[int]
    prompt_len: int
    #: Most drafts this row may take this step (>= 1).
    max_drafts: int
    #: Tenant of the cross-request lookup; None keeps the row out of it.
    tenant: str | None = None
    #: The model's per-sequence state (`SequenceState`: block table, length) for proposers
    #: that run a model (MTP, draft model); host proposers ignore it.
    state: Any = None


class Proposer(ABC):
    """Draft tokens for a batch of rows (zero-cost host proposers and, later, models)."""

    #: The `speculative_config` method name ("ngram", "suffix", ...).
    name: str = ""

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Up to `max_drafts` draft tokens per request (possibly none), in request order."""

    def may_propose(self, seq_id: str) -> bool:
        """Whether a `propose` for this sequence could return drafts now (False while a miss
        backoff holds it): rows that cannot speculate run as plain decode rows, which may
        stay on the device token feed."""
        return True

    def on_verified(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        """Feedback after a verify: `num_accepted` of `num_drafted` drafts were accepted."""
        return None

    def observe(self, seq_id: str, tokens: Sequence[int], tenant: str | None) -> None:
        """A running sequence's committed tokens (prompt + output so far), offered to the
        cross-request index of `tenant`; called for sequences that do not speculate too."""
        return None

    def on_finished(self, seq_id: str, tokens: Sequence[int], tenant: str | None) -> None:
        """The sequence ended (any reason): index its tokens for `tenant` where the proposer
        shares across requests, then drop its per-sequence state."""
        return None

    def stats(self) -> dict[str, int]:
        """Counters for metrics (index sizes, evictions...); empty by default."""
        return {}
