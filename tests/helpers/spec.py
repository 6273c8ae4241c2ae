"""A draft proposer for tests: each prompt's known greedy continuation, some positions wrong.

Owner: tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from metrale.spec.proposer import DraftRequest, Proposer


class ScriptedProposer(Proposer):
    """Proposes each sequence's known continuation, with some positions deliberately wrong.

    `truth` maps a prompt (tuple of ids) to the full greedy output of a run without
    speculation; a draft position is corrupted when a hash of (sequence, position) falls
    under `wrong`, so the pattern of accepts and rejects is fixed but varied."""

    name = "scripted"

    def __init__(self, truth: dict[tuple[int, ...], list[int]], wrong: float = 0.3) -> None:
        self.truth = truth
        self.wrong = wrong
        self.calls = 0
        self.verdicts: list[tuple[int, int]] = []
        self.finished: set[str] = set()

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        self.calls += 1
        out = []
        for r in requests:
            prompt = tuple(r.tokens[: r.prompt_len])
            done = len(r.tokens) - r.prompt_len
            cont = self.truth.get(prompt, [])[done : done + r.max_drafts]
            drafts = []
            for j, token in enumerate(cont):
                # A function of the tokens alone (as a real proposer is), so a seeded
                # request's drafts, hence its tokens, repeat from run to run.
                key = f"{hash(prompt)}:{done}:{j}".encode()
                h = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
                drafts.append((token + 7) % 500 + 6 if h / 2**32 < self.wrong else token)
            out.append(drafts)
        return out

    def on_verified(self, seq_id: str, num_drafted: int, num_accepted: int) -> None:
        self.verdicts.append((num_drafted, num_accepted))

    def on_finished(self, seq_id: str, tokens: Sequence[int], tenant: str | None) -> None:
        self.finished.add(seq_id)
