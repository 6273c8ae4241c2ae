"""Speculative verify in the recurrent layers (Mamba-2, gated delta net): the decode-side rows
that carry drafts run token by token through the decode ops, and each verify row's
checkpoint and per-token recurrence inputs are captured for the commit's rollback.

Owner: layers. `RecurrentVerify` is one forward's capture: the model engine creates it
(`metrale.model_engine.ssm_verify`), `build_forward_batch` lays out its rows and puts it in
`AttentionMetadata.ssm_verify`, the recurrent layers fill it, and after the forward the model
keeps each verify row's `SlotCapture` until that sequence's commit.

Invariants:
- The sequential rows are the `meta.num_sequential` rows after the `meta.num_decode` decode
  rows: every decode-side row from the first one with drafts on. Step `j` of a layer runs the
  j-th token of every sequential row that has one, in one call of the layer's
  `recurrent_step` (the plain decode step's ops), so a verify row's state after token `j` is
  what `j + 1` plain decode steps of those inputs would leave. A Python loop over at most
  `k + 1` steps per layer; nothing else loops over tokens.
- Before step 0 touches a slot, `capture` copies the slot's conv window and SSM state of that
  layer and keeps the row's per-token inputs (clones, never views of the forward's buffers)
  for every row with drafts; single-token rows are never captured.
- `LayerCapture.replay(slot, n)` restores the checkpoint and re-runs the first `n` captured
  tokens through the same `recurrent_step`, one token per call: the state it leaves is, bit
  for bit, the state the verify's step `n - 1` left for that row (the ops compute each row
  independently of the others in the call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

#: A recurrent layer's slot-pool tensors: `(conv_states, ssm_states)`.
SsmState = tuple[torch.Tensor, torch.Tensor]


class RecurrentMixer(Protocol):
    """What a recurrent layer offers the verify path: one decode step over `n` rows whose
    per-token recurrence inputs are `inputs` (each `[n, ...]`), slots `slots` (`[n]`,
    device); returns the step's outputs (the layer decides their form)."""

    def recurrent_step(
        self, inputs: tuple[torch.Tensor, ...], state: SsmState, slots: torch.Tensor
    ) -> tuple[torch.Tensor, ...]: ...


@dataclass
class LayerCapture:
    """One verify row in one recurrent layer: the slot's state before the row and the row's
    per-token recurrence inputs (`[rows, ...]` each; none, and no mixer, for a bare
    checkpoint)."""

    mixer: RecurrentMixer | None
    state: SsmState
    conv: torch.Tensor
    ssm: torch.Tensor
    inputs: tuple[torch.Tensor, ...]

    def restore(self, slot: int) -> None:
        conv_states, ssm_states = self.state
        conv_states[slot].copy_(self.conv)
        ssm_states[slot].copy_(self.ssm)

    def replay(self, slot: int, rows: int) -> None:
        """Restore the checkpoint, then run the first `rows` captured tokens again."""
        self.restore(slot)
        if not rows:
            return
        mixer = self.mixer
        if mixer is None:
            raise ValueError("a bare checkpoint has no rows to replay")
        index = torch.tensor([slot], dtype=torch.int64, device=self.conv.device)
        for j in range(rows):
            mixer.recurrent_step(tuple(t[j : j + 1] for t in self.inputs), self.state, index)


@dataclass
class SlotCapture:
    """One verify row of one forward: its token count (last token plus drafts) and, per
    recurrent layer in call order, its `LayerCapture`."""

    rows: int
    layers: list[LayerCapture] = field(default_factory=list)

    def replay(self, slot: int, rows: int) -> None:
        """Every layer's state of `slot` as after the first `rows` tokens of the row."""
        if not 0 <= rows <= self.rows:
            raise ValueError(f"cannot replay {rows} of a verify row's {self.rows} tokens")
        with torch.inference_mode():  # the pool tensors are inference tensors
            for layer in self.layers:
                layer.replay(slot, rows)


@dataclass
class RecurrentVerify:
    """One forward's sequential rows and what the recurrent layers captured for them."""

    #: Per sequential row: its first token row in the batch, its token count, its SSM slot.
    token_starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    #: Per step `j`: (token rows of the rows longer than `j`, their slots), device int64.
    steps: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: slot -> capture, for each sequential row with drafts (filled by the layers).
    captured: dict[int, SlotCapture] = field(default_factory=dict)

    def lay_out(
        self,
        token_starts: Sequence[int],
        lengths: Sequence[int],
        slots: Sequence[int],
        device: torch.device,
    ) -> None:
        """Set the sequential rows (`build_forward_batch`) and upload each step's indices."""
        self.token_starts, self.lengths, self.slots = list(token_starts), list(lengths), list(slots)
        self.steps = []
        for j in range(max(self.lengths, default=0)):
            live = [i for i, n in enumerate(self.lengths) if n > j]
            rows = torch.tensor([self.token_starts[i] + j for i in live], dtype=torch.int64)
            step_slots = torch.tensor([self.slots[i] for i in live], dtype=torch.int64)
            self.steps.append((rows.to(device), step_slots.to(device)))
        self.captured = {s: SlotCapture(n) for s, n in zip(self.slots, self.lengths) if n > 1}

    def capture(
        self, mixer: RecurrentMixer, state: SsmState, inputs: tuple[torch.Tensor, ...]
    ) -> None:
        """Before the layer's first step: checkpoint each verify row's slot and keep its
        tokens' rows of `inputs` (each `[tokens, ...]`, the whole batch)."""
        conv_states, ssm_states = state
        for start, n, slot in zip(self.token_starts, self.lengths, self.slots):
            if n < 2:
                continue
            self.captured[slot].layers.append(
                LayerCapture(
                    mixer,
                    state,
                    conv_states[slot].clone(),
                    ssm_states[slot].clone(),
                    tuple(t[start : start + n].clone() for t in inputs),
                )
            )

    def run(
        self,
        mixer: RecurrentMixer,
        state: SsmState,
        inputs: tuple[torch.Tensor, ...],
        outputs: tuple[torch.Tensor, ...],
    ) -> None:
        """Capture, then the sequential rows token by token: step `j`'s outputs land in the
        rows of `outputs` (each `[tokens, ...]`) that its inputs came from."""
        self.capture(mixer, state, inputs)
        for rows, slots in self.steps:
            results = mixer.recurrent_step(tuple(t[rows] for t in inputs), state, slots)
            for out, res in zip(outputs, results, strict=True):
                out[rows] = res.to(out.dtype)
