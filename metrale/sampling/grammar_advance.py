"""A step's grammar work off the main thread, split by rows over a few worker threads.

Owner: sampling. `advance_in_chunks` is `GrammarBackend.advance_async`'s body: the constrained
rows' matchers accept their newest tokens (`GrammarState.sync_many`), then the next step's
bitmask rows are filled ahead (`grammar_rows.prefill_rows`), both in chunks of rows, one
worker thread and one xgrammar batch matcher per chunk, so a 64-row step does not run its
accepts one after another (xgrammar's batched accept is a serial loop: ~2.4-2.9 ms for 64
rows of a JSON-schema tool call on the H200 host, ~1.4-1.6 ms in four chunks).

Invariants:
- A state's accept and its prefilled row are in the same chunk, the accept first: a row is
  filled only once its matcher has taken the step's token. Each state is in one chunk.
- The prefilled rows of one call share one host block, in `prefill` order, so the sampler's
  common case (every row prefilled, in order) is one copy (`grammar_rows.fill_rows`).
- The returned future is done once every chunk is; it raises the first chunk's error.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

import torch

from metrale.sampling.grammar_rows import prefill_rows

if TYPE_CHECKING:
    from metrale.sampling.grammar import GrammarState

__all__ = ["MIN_CHUNK_ROWS", "advance_in_chunks"]

#: Fewest rows a chunk is given (fewer rows are not worth a thread hop).
MIN_CHUNK_ROWS = 8


def advance_in_chunks(
    executor: Executor,
    batches: Sequence[Any],
    states: Sequence[GrammarState],
    outputs: Sequence[Sequence[int]],
    prefill: Sequence[GrammarState],
    words: int,
) -> Future[None]:
    """`sync_many(states, outputs)`, then `prefill`'s next rows, in up to `len(batches)`
    chunks of rows run on `executor` (chunk k fills with `batches[k]`)."""
    from metrale.sampling.grammar import GrammarState

    rows = max(len(prefill), len(states))
    count = max(1, min(len(batches), rows // MIN_CHUNK_ROWS))
    chunk_of: dict[int, int] = {
        id(state): j * count // len(prefill) for j, state in enumerate(prefill)
    }
    synced: list[tuple[list[GrammarState], list[Sequence[int]]]] = [([], []) for _ in range(count)]
    for i, (state, output) in enumerate(zip(states, outputs, strict=True)):
        part = synced[chunk_of.get(id(state), i % count)]
        part[0].append(state)
        part[1].append(output)
    block = torch.empty((len(prefill), words), dtype=torch.int32) if prefill else None
    bounds = [(k * len(prefill) + count - 1) // count for k in range(count + 1)]
    # chunk k fills prefill rows bounds[k]..bounds[k+1] (the rows j with j*count//n == k)

    def work(k: int) -> None:
        sync_states, sync_outputs = synced[k]
        if sync_states:
            GrammarState.sync_many(sync_states, sync_outputs)
        start, end = bounds[k], bounds[k + 1]
        if end > start:
            prefill_rows(prefill[start:end], words, block, start, batches[k])

    return _joined([executor.submit(work, k) for k in range(count)])


def _joined(parts: list[Future[None]]) -> Future[None]:
    """A future done when all of `parts` are (the first error, if any, is its error)."""
    if len(parts) == 1:
        return parts[0]
    joined: Future[None] = Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def done(_: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [e for e in (p.exception() for p in parts) if e is not None]
        if errors:
            joined.set_exception(errors[0])
        else:
            joined.set_result(None)

    for part in parts:
        part.add_done_callback(done)
    return joined
