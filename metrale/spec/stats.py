"""Speculative decoding counters, as vLLM names them (`num_drafts`, `num_draft_tokens`,
`num_accepted_tokens`, per-position acceptance), plus the engine's own.

Owner: spec (updated by the engine at each verify commit, read by the server's metrics).

Invariants:
- Counters only grow. `num_drafts` counts verify rows that carried at least one draft;
  `accepted_per_pos[i]` counts rows whose draft `i` (0-based) was accepted, so
  `accepted_per_pos[0] / num_drafts` is the first-draft acceptance rate and
  `sum(accepted_per_pos) == num_accepted_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    #: Engine steps that verified drafts.
    verify_steps: int = 0
    #: Fed-eligible steps read back first because a row could speculate.
    drained_for_spec: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos.extend([0] * (drafted - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify row: 1 + accepted drafts per row (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
