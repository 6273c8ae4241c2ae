"""Batched multi-LoRA: the device slot stacks of every adapted projection, the per-forward
routing of token rows to slots, and the segment op that adds each slot's low-rank delta.

Owner: layers. The slot stacks are written by `metrale.model_engine.lora` (loading,
promotion, eviction); the attention and MLP blocks (`layers/common.py`) call `LoraLayer.add`
after each base projection when the model serves adapters.

Invariants:
- A target is one of the transformers projection names in `LORA_TARGETS`. Per (layer, target)
  the stacks are `a [slots, max_rank, in]` and `b_t [slots, max_rank, out]` (B transposed, so a
  slot's first `rank` rows are contiguous); a slot's rows past its rank, and every row of a
  target it does not adapt, are never read.
- The routing of one forward (`LoraBatch`) names, per slot present, the token rows that use it
  (the segment op, eager forwards); or, with `groups` None, only `token_slots`, one device
  tensor that the gather op (`KernelOps.lora_gather_add`: torch, or Triton on CUDA) reads
  per row: what a captured decode graph runs, the slot tensor being a graph input. Rows of
  the base model (slot -1) get no delta either way.
- A slot's stack rows are zero past its rank and for targets it does not adapt (the gather
  op reads all `max_rank` rows of every target).
- The delta of a row using slot s on a target is `(x @ A_s.T) @ B_s.T * scale_s`, added to the
  base projection's output for that target (peft's order: base, then the delta), in the
  output's dtype. Rows of other slots and base rows are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from metrale.kernels import reference

#: The projections an adapter may target, in transformers' names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraBatch:
    """Which token rows of one forward use which slot."""

    #: `[tokens]` int64 on the device: each token row's slot, -1 for the base model.
    token_slots: torch.Tensor
    #: Per slot present: (slot, token row indices on the device; None when every row uses it).
    #: None routes by `token_slots` alone (the gather op; what a captured graph runs, since
    #: it reads nothing on the host).
    groups: list[tuple[int, torch.Tensor | None]] | None

    @classmethod
    def build(
        cls, row_slots: list[int], query_lens: list[int], device: torch.device
    ) -> LoraBatch | None:
        """The routing of rows `row_slots[i]` (each `query_lens[i]` tokens, in order); None
        when every row runs the base model."""
        if all(s < 0 for s in row_slots):
            return None
        per_token = np.repeat(np.asarray(row_slots, dtype=np.int64), query_lens)
        groups: list[tuple[int, torch.Tensor | None]] = []
        present = sorted({s for s in row_slots if s >= 0})
        if len(present) == 1 and all(s >= 0 for s in row_slots):
            groups.append((present[0], None))
        else:
            for slot in present:
                idx = np.flatnonzero(per_token == slot)
                groups.append((slot, torch.from_numpy(idx).to(device)))
        return cls(torch.from_numpy(per_token).to(device), groups)


def lora_segment_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    groups: list[tuple[int, torch.Tensor | None]],
    ranks: list[int],
    scales: list[float],
) -> None:
    """`y[rows of s] += (x[rows of s] @ a[s, :r].T) @ b_t[s, :r] * scale[s]` for each slot
    group; `ranks[s] == 0` means slot s does not adapt this target. The torch reference (a
    segment matmul: one pair of GEMMs per slot present)."""
    for slot, idx in groups:
        r = ranks[slot]
        if r == 0:
            continue
        xs = x if idx is None else x.index_select(0, idx)
        delta = torch.nn.functional.linear(xs, a[slot, :r]) @ b_t[slot, :r]
        delta = delta * scales[slot]
        if idx is None:
            y += delta.to(y.dtype)
        else:
            y.index_add_(0, idx, delta.to(y.dtype))


class LoraSlots:
    """The device stacks of every adapted projection and each slot's ranks and scales."""

    def __init__(
        self,
        shapes: dict[tuple[int, str], tuple[int, int]],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        gather_op: Callable[..., None] = reference.lora_gather_add,
    ) -> None:
        """`shapes`: (layer, target) -> (in features, out features) of each adaptable
        projection; `gather_op`: the device routing's op (`KernelOps.lora_gather_add`)."""
        self.gather_op = gather_op
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.shapes = dict(shapes)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b_t: dict[tuple[int, str], torch.Tensor] = {}
        self.ranks: dict[tuple[int, str], list[int]] = {}
        self.scales: dict[tuple[int, str], list[float]] = {}
        #: `scales` on the device, float32 `[slots]` (0 where a slot does not adapt).
        self.scales_dev: dict[tuple[int, str], torch.Tensor] = {}
        for key, (fan_in, fan_out) in self.shapes.items():
            self.a[key] = torch.zeros(num_slots, max_rank, fan_in, dtype=dtype, device=device)
            self.b_t[key] = torch.zeros(num_slots, max_rank, fan_out, dtype=dtype, device=device)
            self.ranks[key] = [0] * num_slots
            self.scales[key] = [0.0] * num_slots
            self.scales_dev[key] = torch.zeros(num_slots, dtype=torch.float32, device=device)
        #: The routing of the forward being run; None outside a forward or when no row uses
        #: an adapter.
        self.batch: LoraBatch | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b_t.values()))

    def clear_slot(self, slot: int) -> None:
        """Mark `slot` as adapting nothing, its rows zeroed (the gather op reads them all)."""
        for key in self.shapes:
            self.ranks[key][slot] = 0
            self.scales[key][slot] = 0.0
            self.scales_dev[key][slot] = 0.0
            self.a[key][slot].zero_()
            self.b_t[key][slot].zero_()

    def write_slot(
        self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    ) -> None:
        """Install one adapter into `slot`: per (layer, target), `(A [r, in], B [out, r],
        scale)`; targets it lacks are marked absent."""
        self.clear_slot(slot)
        for key, (a, b, scale) in weights.items():
            r = a.shape[0]
            self.a[key][slot, :r].copy_(a)
            self.b_t[key][slot, :r].copy_(b.t())
            self.ranks[key][slot] = r
            self.scales[key][slot] = scale
            self.scales_dev[key][slot] = scale

    def layer(self, layer_idx: int) -> LoraLayer:
        return LoraLayer(self, layer_idx)


class LoraLayer:
    """One decoder layer's view of the slots: what its attention and MLP blocks call."""

    def __init__(self, slots: LoraSlots, layer_idx: int) -> None:
        self.slots = slots
        self.layer_idx = layer_idx

    def active(self) -> bool:
        return self.slots.batch is not None

    def adapts(self, target: str) -> bool:
        """Whether a slot of the current forward adapts `target` in this layer (under
        device routing: whether any slot could)."""
        batch = self.slots.batch
        ranks = self.slots.ranks.get((self.layer_idx, target))
        if batch is None or ranks is None:
            return False
        if batch.groups is None:
            return True
        return any(ranks[slot] for slot, _ in batch.groups)

    def add(self, x: torch.Tensor, y: torch.Tensor, targets: list[tuple[str, int, int]]) -> None:
        """Add the deltas of `targets` — (name, first column, column count) of `y`, the
        (possibly fused) base output computed from `x` — for the current forward's rows."""
        slots, batch = self.slots, self.slots.batch
        if batch is None:
            return
        for name, start, width in targets:
            key = (self.layer_idx, name)
            if key not in slots.shapes:
                continue
            if batch.groups is None:
                slots.gather_op(
                    y[:, start : start + width], x, slots.a[key], slots.b_t[key],
                    batch.token_slots, slots.scales_dev[key],
                )  # fmt: skip
                continue
            lora_segment_add(
                y[:, start : start + width], x, slots.a[key], slots.b_t[key], batch.groups,
                slots.ranks[key], slots.scales[key],
            )  # fmt: skip
