"""`MtpProposer`: speculative method "mtp": drafts from the checkpoint's multi-token-prediction
head, run by the model (`TransformerModel.mtp_propose`, `metrale/model_engine/mtp.py`).

Owner: engine (built by `speculation.build_proposer`).

Invariants:
- Holds no per-sequence state of its own: the head's pending hidden rows and KV live with the
  model's `SequenceState` (`proposer_state`), so preemption, swap and free need nothing here.
- A row is offered to the head only when its committed tokens are exactly the model's
  tokens plus the newest one (no step in flight for it); otherwise it gets no drafts.
- Counts the rows the head could not draft for (`stats()["mtp_no_draft_rows"]`).
"""

from __future__ import annotations

from collections.abc import Sequence

from metrale.errors import InvalidRequestError
from metrale.model_engine.traits import Model, SequenceState
from metrale.spec.proposer import DraftRequest, Proposer


class MtpProposer(Proposer):
    name = "mtp"

    def __init__(self, model: Model, k: int) -> None:
        if not model.has_proposer():
            raise InvalidRequestError(
                "speculative method 'mtp' needs the model built with its MTP head drafting",
                param="speculative_config.method",
            )
        self.model = model
        self.k = k
        self.no_draft_rows = 0
        self.drafted_rows = 0

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        seqs: list[SequenceState] = []
        newest: list[int] = []
        room: list[int] = []
        index: list[int] = []
        out: list[list[int]] = [[] for _ in requests]
        for i, r in enumerate(requests):
            state = r.state
            if not isinstance(state, SequenceState) or len(r.tokens) != state.seq_len + 1:
                self.no_draft_rows += 1
                continue
            seqs.append(state)
            newest.append(int(r.tokens[-1]))
            room.append(min(self.k, r.max_drafts))
            index.append(i)
        if not seqs:
            return out
        drafts = self.model.mtp_propose(seqs, newest, room)  # type: ignore[attr-defined]
        for i, d in zip(index, drafts, strict=True):
            out[i] = d
            if d:
                self.drafted_rows += 1
            else:
                self.no_draft_rows += 1
        return out

    def stats(self) -> dict[str, int]:
        return {"mtp_drafted_rows": self.drafted_rows, "mtp_no_draft_rows": self.no_draft_rows}
