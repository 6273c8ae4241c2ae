"""A step's grammar bitmask: filled on the host, sent to the logits' device, applied there.

Owner: sampling. `grammar_bitmask` syncs each constrained row's `GrammarState` to its output,
fills one bitmask row per state on the host (prefilled rows copied, the rest in one batched
xgrammar call: `grammar_rows.fill_rows`) and sends the `[rows, ceil(V / 32)]` int32 words to
the device; `apply_grammar_masks` sets every token the grammar forbids to -inf through the
`apply_token_bitmask` op (the torch reference, or one Triton launch on CUDA), and the sampler's
greedy grammar rows skip the masked logits altogether (`KernelOps.masked_argmax` reads the
words beside the logits).

Invariants:
- No host<->device sync: the host fills the backend's `MaskStaging` buffer (on CUDA pinned and
  reused, a buffer refilled only after its previous copy is done: an event queued a step
  earlier), the copy is non-blocking and the rest are device ops. The caller's logits are
  never written.
- A verify row's positions share one state and are synced and filled one after the other, in
  order (position j after the output plus drafts 0..j-1), so each position's mask is the
  grammar's after exactly those tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from metrale.sampling.grammar_rows import fill_rows

if TYPE_CHECKING:
    from metrale.kernels import KernelOps
    from metrale.sampling.grammar import GrammarState

__all__ = ["MaskStaging", "apply_grammar_masks", "bitmask_words", "grammar_bitmask"]


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


class MaskStaging:
    """Host buffers the constrained rows' bitmask is filled in and sent to the device from,
    reused step after step (one per backend). On CUDA they are pinned, two in turn, and a
    buffer is written again only once its last copy to the device is done (an event): a
    fresh pinned tensor every step cost ~0.4 ms at 64 rows of a 152k vocabulary on the H200
    host. Elsewhere a buffer is a plain tensor and the mask is used where it is."""

    SLOTS = 2

    def __init__(self) -> None:
        self._buffers: list[Tensor | None] = [None] * self.SLOTS
        self._copied: list[Any] = [None] * self.SLOTS
        self._next = 0
        #: Times a buffer's previous copy was still running when it was wanted again.
        self.waits = 0

    def buffer(self, rows: int, words: int, device: torch.device) -> Tensor:
        """A `[rows, words]` int32 host tensor to fill (its contents are stale)."""
        if device.type != "cuda":
            return torch.empty((rows, words), dtype=torch.int32)
        slot = self._next
        event = self._copied[slot]
        if event is not None:
            if not event.query():  # its copy was queued a step or more ago: done by now
                self.waits += 1
                event.synchronize()
            self._copied[slot] = None
        flat = self._buffers[slot]
        if flat is None or flat.numel() < rows * words:
            flat = torch.empty(rows * words, dtype=torch.int32, pin_memory=True)
            self._buffers[slot] = flat
        return flat[: rows * words].view(rows, words)

    def to_device(self, host: Tensor, device: torch.device) -> Tensor:
        """`host` (the tensor `buffer` gave last) on `device`, copied without a sync."""
        if device.type != "cuda":
            return host.to(device)
        slot = self._next
        self._next = (slot + 1) % self.SLOTS
        mask = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[slot] = event
        return mask


def grammar_bitmask(
    device: torch.device,
    vocab: int,
    states: Sequence[GrammarState],
    tokens: Sequence[Sequence[int]],
    committed: Sequence[int | None] | None = None,
) -> Tensor:
    """`[len(states), ceil(vocab / 32)]` int32 on `device`: row j what `states[j]` allows
    after `tokens[j]` (that sequence's output, which the state is synced to first). A verify
    row's positions share one state: `tokens[j]` is then the output plus the drafts before
    that position, `committed[j]` the output's length (see `GrammarState.fill`)."""
    from metrale.sampling.processing import to_device

    words = bitmask_words(vocab)
    staging = states[0].staging if states else None
    if staging is not None:
        host = staging.buffer(len(states), words, device)
    else:
        host = torch.empty((len(states), words), dtype=torch.int32)
    shared = len({id(state) for state in states}) < len(states)
    if not shared and (committed is None or all(c is None for c in committed)):
        for state, output in zip(states, tokens, strict=True):
            state.sync(output)
        fill_rows(host, states)
    else:
        for j, (state, output) in enumerate(zip(states, tokens, strict=True)):
            own = committed[j] if committed is not None else None
            state.sync(output, own)
            state.fill(host, j, own)
    if staging is not None:
        return staging.to_device(host, device)
    return to_device(host, torch.int32, device)


def apply_grammar_masks(
    x: Tensor,
    rows: Sequence[int],
    states: Sequence[GrammarState],
    tokens: Sequence[Sequence[int]],
    committed: Sequence[int | None] | None = None,
    ops: KernelOps | None = None,
) -> Tensor:
    """`x` (`[B, V]` float32) with row `rows[j]` (increasing) limited to what `states[j]`
    allows after `tokens[j]` (`grammar_bitmask`). Out of place. `ops`: the op set whose
    `apply_token_bitmask` masks (None: the torch reference)."""
    from metrale.kernels import reference
    from metrale.sampling.processing import to_device

    mask = grammar_bitmask(x.device, x.shape[1], states, tokens, committed)
    apply = ops.apply_token_bitmask if ops is not None else reference.apply_token_bitmask
    if len(rows) == x.shape[0]:
        return apply(x, mask)
    return apply(x, mask, to_device(list(rows), torch.int64, x.device))
