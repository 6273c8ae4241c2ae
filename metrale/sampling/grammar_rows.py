"""The bitmask rows of a step's grammar states, filled on the host: rows filled ahead
(`prefill_rows`, by the worker threads of `grammar_advance`) and the step's rows
(`fill_rows`), which copies a prefilled row still valid and fills the others in one batched
xgrammar call.

Owner: sampling, beside `grammar.GrammarState`, whose matcher and prefilled-row fields these
functions read and write (its module docstring states the prefilled row's rule).

Invariants:
- A prefilled row is used only while its state stays at the position (synced-list version,
  accepted count, termination) it was filled at; `fill_rows` consumes every state's
  prefilled row (used or dropped), so none outlives its step.
- Each state's row is written exactly once per `fill_rows` call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from metrale.sampling.grammar import GrammarState

__all__ = ["fill_rows", "prefill_rows"]


def prefill_rows(
    states: Sequence[GrammarState],
    words: int,
    block: Tensor | None = None,
    start: int = 0,
    batch: Any = None,
) -> None:
    """Fill each state's next bitmask row now (`states[j]` in row `start + j` of `block`,
    a fresh one when None) and keep it with the position it is valid at; a later
    `fill_rows` at that same position copies it instead of filling. `batch`: the xgrammar
    batch matcher to fill with (None: the states' own)."""
    if block is None:
        block = torch.empty((len(states), words), dtype=torch.int32)
    fill_rows(block[start : start + len(states)], states, batch)
    for j, state in enumerate(states):
        state._prefilled = (state._position(), block, start + j)


def fill_rows(bitmask: Tensor, states: Sequence[GrammarState], batch: Any = None) -> None:
    """`bitmask[j]` for every `states[j]` (each state once): rows prefilled at the
    state's current position copied, the other live ones in one batched xgrammar call
    (threads; `batch`, else the states' own matcher), the rest one by one."""
    if _copy_prefilled_block(bitmask, states):
        return
    ahead: list[int] = []
    unfilled: list[int] = []
    #: id(prefilled block) -> (the block, the rows here, their rows there)
    by_block: dict[int, tuple[Tensor, list[int], list[int]]] = {}
    for j, state in enumerate(states):
        pre, state._prefilled = state._prefilled, None
        if pre is not None and pre[0] == state._position():
            entry = by_block.setdefault(id(pre[1]), (pre[1], [], []))
            entry[1].append(j)
            entry[2].append(pre[2])
            ahead.append(j)
            state.prefill_hits += 1
        else:
            unfilled.append(j)
    for source, rows, from_rows in by_block.values():  # one gather per block, not per row
        picked = source.index_select(0, torch.tensor(from_rows, dtype=torch.int64))
        bitmask.index_copy_(0, torch.tensor(rows, dtype=torch.int64), picked)
    if ahead:  # fill the others into a scratch and put each row in its place
        if unfilled:
            sub = torch.empty((len(unfilled), bitmask.shape[1]), dtype=bitmask.dtype)
            fill_rows(sub, [states[j] for j in unfilled], batch)
            bitmask.index_copy_(0, torch.tensor(unfilled, dtype=torch.int64), sub)
        return
    live = [j for j, state in enumerate(states) if state.live]
    if live and batch is None:
        batch = states[live[0]]._batch
    if batch is not None and len(live) > 1:
        batch.batch_fill_next_token_bitmask([states[j]._matcher for j in live], bitmask, live)
        by_extra: dict[int, tuple[Tensor, list[int]]] = {}
        for j in live:  # rows sharing an extra mask (JSON's no-control row) in one op
            extra = states[j]._extra_mask
            if extra is not None:
                by_extra.setdefault(id(extra), (extra, []))[1].append(j)
        for extra, rows in by_extra.values():
            index = torch.tensor(rows, dtype=torch.int64)
            bitmask.index_copy_(0, index, bitmask.index_select(0, index) & extra)
        live_set = set(live)
        rest = [j for j in range(len(states)) if j not in live_set]
    else:
        rest = list(range(len(states)))
    for j in rest:
        states[j].fill(bitmask, j)


def _copy_prefilled_block(bitmask: Tensor, states: Sequence[GrammarState]) -> bool:
    """The engine's common case in one light pass: row j of one prefilled block holds
    `states[j]`'s row at its current position, for every j; then one copy. False (and
    nothing changed) otherwise."""
    first = states[0]._prefilled if states else None
    if first is None or first[1].shape != bitmask.shape:
        return False
    block = first[1]
    for j, state in enumerate(states):
        pre = state._prefilled
        if pre is None or pre[1] is not block or pre[2] != j or pre[0] != state._position():
            return False
    for state in states:
        state._prefilled = None
        state.prefill_hits += 1
    bitmask.copy_(block)
    return True
