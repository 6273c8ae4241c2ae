"""The beam driver's per-request and per-width state: `Phys` (a physical sequence and the
token it feeds next), `BeamState` (one request's beams and finished hypotheses), `BeamGroup`
(the requests of one beam width: their search state as `[R, k]` tensors where the logits
are, their token history as host arrays), and `beam_bans` (the tokens a beam's processors
forbid).

Owner: model-engine (`metrale.model_engine.beam` is the one user; its docstring states the
search and the sharing rules these types keep).
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.model_engine.beam_backend import BeamRequest
from metrale.model_engine.traits import SequenceState

#: The score that keeps a continuation out of a top-k (transformers' large negative).
NEG = -1.0e9


class Phys:
    """A physical sequence and the token it feeds next; `check`: its last block may be
    shared (it was just started or forked), so the next step looks at it for copy-on-write."""

    __slots__ = ("check", "pending", "seq")

    def __init__(self, seq: SequenceState, pending: int) -> None:
        self.seq = seq
        self.pending = pending
        self.check = True


class BeamState:
    """One running request's host side: its beams' physical sequences. Its search tensors and
    token arrays are row `row` of its beam width's `BeamGroup`."""

    __slots__ = ("bans", "base", "eos_ids", "forced", "group", "k", "keep", "max_new",
                 "min_new", "req", "row", "steps", "uniq")  # fmt: skip

    def __init__(self, req: BeamRequest, eos: tuple[int, ...], phys: Phys) -> None:
        p = req.params
        self.req = req
        self.eos_ids = eos
        self.k = p.num_beams
        self.forced = len(req.forced)
        self.max_new = p.max_tokens + self.forced
        self.min_new = p.min_tokens + self.forced
        self.keep = max(2, 1 + len(eos)) * self.k
        #: Whether the request's processors can ban tokens (no_repeat_ngram / min_tokens).
        self.bans = p.no_repeat_ngram_size > 0 or self.min_new > self.forced
        #: The beams' distinct physical sequences in first-appearance order (the order of
        #: their decoder rows); which beam feeds which is the group's `slot_idx` row.
        self.uniq: list[Phys] = [phys]
        self.group: BeamGroup | None = None
        self.row = 0  # index in the group
        self.base = 0  # the first decoder row of this step
        self.steps = 0

    def physicals(self) -> list[Phys]:
        return self.uniq


class BeamGroup:
    """The requests of one beam width `k`, batched: the search state as `[R, k]` tensors where
    the logits are (running scores, finished scores and flags, the heuristic flag) and the
    token history as host arrays (`gen`: every beam's generated tokens `[R, k, L]`; `fin_tok`:
    the finished hypotheses'; -1 past a row's end), so a step runs no per-beam Python for the
    search."""

    def __init__(self, k: int, keep: int) -> None:
        self.k, self.keep = k, keep
        self.states: list[BeamState] = []
        self.dev = torch.device("cpu")
        self.running = torch.zeros(0, k, dtype=torch.float32)
        self.fin_scores = torch.zeros(0, k, dtype=torch.float32)
        self.fin_done = torch.zeros(0, k, dtype=torch.bool)
        self.heuristic = torch.zeros(0, dtype=torch.bool)
        self.width = 1
        self.first_keep = np.arange(keep)[None, :]
        self.gen = np.full((0, k, 1), -1, dtype=np.int64)
        self.fin_tok = np.full((0, k, 1), -1, dtype=np.int64)
        self.gen_len = np.zeros(0, dtype=np.int64)
        # Per-request constants.
        self.forced_len = np.zeros(0, dtype=np.int64)
        self.max_new = np.zeros(0, dtype=np.int64)
        self.min_new = np.zeros(0, dtype=np.int64)
        self.early = np.zeros(0, dtype=np.int64)
        self.lp = np.zeros(0, dtype=np.float64)
        self.never = np.zeros(0, dtype=bool)
        self.bans = np.zeros(0, dtype=bool)
        #: Which beam of each request feeds which of its distinct physicals (-1: dead).
        self.slot_idx = np.zeros((0, k), dtype=np.int64)

    def add(self, states: list[BeamState]) -> None:
        k, n = self.k, len(states)
        for i, st in enumerate(states):
            st.group, st.row = self, len(self.states) + i
        self.states += states
        running = torch.full((n, k), NEG, dtype=torch.float32)
        running[:, 0] = 0.0
        new = (
            running,
            torch.full((n, k), NEG, dtype=torch.float32),
            torch.zeros(n, k, dtype=torch.bool),
            torch.ones(n, dtype=torch.bool),
        )
        if self.dev.type != "cpu":
            new = tuple(t.to(self.dev, non_blocking=True) for t in new)
        self.running = torch.cat((self.running, new[0]))
        self.fin_scores = torch.cat((self.fin_scores, new[1]))
        self.fin_done = torch.cat((self.fin_done, new[2]))
        self.heuristic = torch.cat((self.heuristic, new[3]))
        width = max(self.width, *(st.max_new for st in states))
        if width > self.width:
            pad = ((0, 0), (0, 0), (0, width - self.width))
            self.gen = np.pad(self.gen, pad, constant_values=-1)
            self.fin_tok = np.pad(self.fin_tok, pad, constant_values=-1)
            self.width = width
        fresh = np.full((n, k, width), -1, dtype=np.int64)
        self.gen = np.concatenate((self.gen, fresh))
        self.fin_tok = np.concatenate((self.fin_tok, fresh))
        self.gen_len = np.concatenate((self.gen_len, np.zeros(n, dtype=np.int64)))
        ps = [st.req.params for st in states]

        def cat(old: np.ndarray, vals: list[object]) -> np.ndarray:
            return np.concatenate((old, np.asarray(vals, dtype=old.dtype)))

        self.forced_len = cat(self.forced_len, [st.forced for st in states])
        self.max_new = cat(self.max_new, [st.max_new for st in states])
        self.min_new = cat(self.min_new, [st.min_new for st in states])
        self.early = cat(self.early, [int(p.early_stopping is True) for p in ps])
        self.lp = cat(self.lp, [float(p.length_penalty) for p in ps])
        self.never = cat(
            self.never, [p.early_stopping == "never" and p.length_penalty > 0.0 for p in ps]
        )
        self.bans = cat(self.bans, [st.bans for st in states])
        # Every beam starts on the prompt's one sequence (beam 0 scores 0, the others -inf).
        self.slot_idx = np.concatenate((self.slot_idx, np.zeros((n, k), dtype=np.int64)))

    def remove(self, gone: set[int]) -> None:
        """Drop the rows in `gone` (indices), keeping the others' order."""
        kept = [i for i in range(len(self.states)) if i not in gone]
        self.states = [self.states[i] for i in kept]
        for i, st in enumerate(self.states):
            st.row = i
        idx = np.asarray(kept, dtype=np.int64)
        dev_idx = torch.from_numpy(idx).to(self.dev, non_blocking=True)
        self.running = self.running.index_select(0, dev_idx)
        self.fin_scores = self.fin_scores.index_select(0, dev_idx)
        self.fin_done = self.fin_done.index_select(0, dev_idx)
        self.heuristic = self.heuristic.index_select(0, dev_idx)
        for name in ("gen", "fin_tok", "gen_len", "forced_len", "max_new", "min_new",
                     "early", "lp", "never", "bans", "slot_idx"):  # fmt: skip
            setattr(self, name, getattr(self, name)[idx])

    def to(self, dev: torch.device) -> None:
        if self.dev != dev:
            self.dev = dev
            self.running, self.fin_scores = self.running.to(dev), self.fin_scores.to(dev)
            self.fin_done, self.heuristic = self.fin_done.to(dev), self.heuristic.to(dev)


def beam_bans(st: BeamState, gen: list[int]) -> list[int]:
    """Tokens a beam's processors set to -inf (`no_repeat_ngram_size`, `min_tokens`) after
    its generated tokens `gen`; a beam still in its forced prefix is handled by the caller."""
    p = st.req.params
    banned: set[int] = set()
    n = p.no_repeat_ngram_size
    if n:
        tokens = st.req.prompt + gen
        if len(tokens) + 1 >= n:
            prefix = tuple(tokens[len(tokens) - n + 1 :]) if n > 1 else ()
            banned = {
                tokens[i + n - 1]
                for i in range(len(tokens) - n + 1)
                if tuple(tokens[i : i + n - 1]) == prefix
            }
    if len(gen) < st.min_new:
        banned.update(st.eos_ids)
    return sorted(banned)
