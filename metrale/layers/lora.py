"""Batched multi-LoRA: the device slot stacks of every adapted projection, the per-forward
routing of token rows to slots, and the segment op that adds each slot's low-rank delta.

Owner: layers. The slot stacks are written by `metrale.model_engine.lora` (loading,
promotion, eviction); the attention and MLP blocks (`layers/common.py`) call `LoraLayer.add`
after each base projection when the model serves adapters.

Invariants:
- A target is one of the transformers projection names in `LORA_TARGETS`. The targets of one
  base projection call share their input and are stored as one group (`LORA_GROUPS`: q/k/v,
  o, gate/up, down): `a [slots, T, max_rank, in]`, `b_t [slots, max_rank, sum of outs]` (B
  transposed, the targets' columns side by side in the base output's order) and `scales
  [slots, T]`. Per (layer, target), `a`, `b_t` and `scales_dev` are views into the group, so
  the eager segment op reads one target and the gather op one whole group in one launch pair.
  A slot's rows past its rank, and every row of a target it does not adapt, are never read.
- The routing of one forward (`LoraBatch`) names, per slot present, the token rows that use it
  (the segment op, eager forwards on the CPU); or, with `groups` None, only `token_slots`,
  one device tensor that the gather op (`KernelOps.lora_gather_add`: torch, or Triton on
  CUDA) reads per row: what a captured decode graph runs, the slot tensor being a graph
  input; or its `tiles` (runs of at most `TILE_ROWS` rows of one slot), which the tiled op
  (`KernelOps.lora_tiles_add`) reads: eager forwards on CUDA. Rows of
  the base model (slot -1) get no delta either way.
- Under device routing with a plan op (`KernelOps.lora_plan`, CUDA) and at least
  `PLAN_MIN_ROWS` token rows, the first `add` of a forward groups the rows by slot on the
  device (`LoraSlots.plan`: `order` and `tiles`, kept on the batch for every later layer;
  captured with the graph, no host read) and every group runs the tiled op through `order`,
  reading each adapter once per tile of its rows (SGMV-like); fewer rows keep the gather
  op (`triton_lora.lora_gather_add`), or, with a linear op (`KernelOps.lora_linear` on
  CUDA) and a group covering the whole output of a float (not FP8) projection, the layers'
  `LoraLayer.project` runs projection and deltas as one op (at the GEMV's rows: the shrink,
  then the GEMV adding the expand as it stores, `triton_lora_epilogue`).
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
from torch import nn

from metrale.kernels import KernelOps, lora_reference
from metrale.layers.fp8_linear import project as base_project

#: The projections an adapter may target, in transformers' names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The targets computed by one base projection from one input (fused qkv, o, fused gate/up,
#: down), in the order of their columns in that projection's output.
LORA_GROUPS = (
    ("q_proj", "k_proj", "v_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj"),
    ("down_proj",),
)


#: Token rows per tile of the tiled op (`KernelOps.lora_tiles_add`; the kernels' row tile).
TILE_ROWS = lora_reference.LORA_TILE_ROWS
#: Device routing groups rows by slot (`LoraSlots.plan`) from this many token rows up; below
#: it the per-row gather op reads each row's adapter itself (fewer launches, and with few
#: rows there is little for a tile to share). 8: on the H200 (Qwen3-8B shapes, rank 16, 8
#: adapters) grouped tiles took 37.9 us a layer at 8 rows against the gather op's 49.3 (and
#: 55.6 against 220.8 at 64 rows; even at one row, 22.1 against 22.5; record
#: `bench/records/20261202T011500-lora-kernels-qwen3-8b.json`).
PLAN_MIN_ROWS = 8


@dataclass
class LoraGroup:
    """One layer's stacks of the targets of one base projection (see the module invariants)."""

    targets: tuple[str, ...]
    widths: tuple[int, ...]
    a: torch.Tensor
    b_t: torch.Tensor
    scales: torch.Tensor


@dataclass
class LoraBatch:
    """Which token rows of one forward use which slot."""

    #: `[tokens]` int64 on the device: each token row's slot, -1 for the base model.
    token_slots: torch.Tensor
    #: Per slot present: (slot, token row indices on the device; None when every row uses it).
    #: None routes by `token_slots` alone (the gather op; what a captured graph runs, since
    #: it reads nothing on the host).
    groups: list[tuple[int, torch.Tensor | None]] | None
    #: `[n, 3]` int32 on the device: (first token row, row count <= `TILE_ROWS`, slot) of
    #: each tile of adapted rows (base rows in none): what the tiled op reads (`route`); or
    #: (first index into `order`, row count, slot) when planned on the device (`LoraSlots.plan`).
    tiles: torch.Tensor | None = None
    #: `[tokens]` int32 on the device: the token rows grouped by slot, when `tiles` index it
    #: (`LoraSlots.plan`); None: `tiles` name token rows directly.
    order: torch.Tensor | None = None

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
        tiles: list[tuple[int, int, int]] = []
        first = 0
        for slot, n in zip(row_slots, query_lens, strict=True):
            if slot >= 0:
                tiles += [(first + i, min(TILE_ROWS, n - i), slot) for i in range(0, n, TILE_ROWS)]
            first += n
        tile_tensor = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).to(device)
        return cls(torch.from_numpy(per_token).to(device), groups, tile_tensor)


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
        gather_op: Callable[..., None] = lora_reference.lora_gather_add,
        tiles_op: Callable[..., None] | None = None,
        plan_op: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
        plan_min_rows: int = PLAN_MIN_ROWS,
        linear_op: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """`shapes`: (layer, target) -> (in features, out features) of each adaptable
        projection; `gather_op`: the device routing's op (`KernelOps.lora_gather_add`);
        `tiles_op`: when given (`KernelOps.lora_tiles_add` on CUDA), eager forwards run it,
        one launch pair per group whatever the slots present, instead of the segment op's
        GEMM pairs per slot (see `route`); `plan_op`: with `tiles_op`
        (`KernelOps.lora_plan` on CUDA), device routing of at least `plan_min_rows` token
        rows groups them by slot on the device and runs the tiled op (see `plan`);
        `linear_op` (`KernelOps.lora_linear` on CUDA): device routing below the plan runs
        each float projection with its group's deltas through it (`LoraLayer.project`)."""
        if plan_op is not None and tiles_op is None:
            raise ValueError("a LoRA plan op needs the tiled op to run its tiles")
        self.gather_op = gather_op
        self.tiles_op = tiles_op
        self.plan_op = plan_op
        self.plan_min_rows = plan_min_rows
        #: Forwards whose device routing was grouped by slot (`plan`): a metric of which op
        #: the decode graphs run (counted at capture, or per eager run).
        self.planned = 0
        self.linear_op = linear_op
        #: Projections run with their deltas by `linear_op` (counted at capture, or per eager
        #: run): where the few-row forms fold the expand into the base GEMV.
        self.linear_calls = 0
        #: On CUDA, the gather op's barrier counters (int32 zeros, left zero by every call;
        #: the decode graphs' calls are stream-ordered): its one-launch "sync" form needs them.
        self.sync = (
            torch.zeros(4, dtype=torch.int32, device=device) if device.type == "cuda" else None
        )
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.shapes = dict(shapes)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b_t: dict[tuple[int, str], torch.Tensor] = {}
        self.ranks: dict[tuple[int, str], list[int]] = {}
        self.scales: dict[tuple[int, str], list[float]] = {}
        #: `scales` on the device, float32 `[slots]` (0 where a slot does not adapt).
        self.scales_dev: dict[tuple[int, str], torch.Tensor] = {}
        #: (layer, first target of its group) -> the group's stacks.
        self.groups: dict[tuple[int, str], LoraGroup] = {}
        for layer in sorted({layer for layer, _ in self.shapes}):
            for members in LORA_GROUPS:
                names = tuple(t for t in members if (layer, t) in self.shapes)
                if not names:
                    continue
                fan_ins = {self.shapes[(layer, t)][0] for t in names}
                if len(fan_ins) != 1:
                    raise ValueError(f"layer {layer}: targets {names} differ in input size")
                widths = tuple(self.shapes[(layer, t)][1] for t in names)
                group = LoraGroup(
                    names, widths,
                    torch.zeros(num_slots, len(names), max_rank, fan_ins.pop(), dtype=dtype,
                                device=device),
                    torch.zeros(num_slots, max_rank, sum(widths), dtype=dtype, device=device),
                    torch.zeros(num_slots, len(names), dtype=torch.float32, device=device),
                )  # fmt: skip
                self.groups[(layer, names[0])] = group
                start = 0
                for j, (name, width) in enumerate(zip(names, widths, strict=True)):
                    key = (layer, name)
                    self.a[key] = group.a[:, j]
                    self.b_t[key] = group.b_t[:, :, start : start + width]
                    self.scales_dev[key] = group.scales[:, j]
                    self.ranks[key] = [0] * num_slots
                    self.scales[key] = [0.0] * num_slots
                    start += width
        if set(self.a) != set(self.shapes):
            raise ValueError(
                f"targets outside LORA_TARGETS: {sorted(set(self.shapes) - set(self.a))}"
            )
        #: The routing of the forward being run; None outside a forward or when no row uses
        #: an adapter.
        self.batch: LoraBatch | None = None

    def route(self, batch: LoraBatch | None) -> LoraBatch | None:
        """The routing an eager forward runs: `batch` itself (the segment op), or, with a
        tiled op, its tiles alone. On CUDA the tiled kernels beat the segment op's two GEMMs
        and two index ops per slot, group and layer (launches bound those), and read each
        adapter once per tile, where the per-token gather op reads it once per token."""
        if batch is None or batch.groups is None or self.tiles_op is None:
            return batch
        return LoraBatch(batch.token_slots, None, batch.tiles)

    def plan(self, batch: LoraBatch) -> None:
        """Under device routing (`batch.groups` None, no tiles yet) with a plan op and at
        least `plan_min_rows` token rows: group the rows by slot on the device, once per
        forward (`batch.order`, `batch.tiles`, read by every later layer)."""
        if (
            self.plan_op is None
            or batch.groups is not None
            or batch.tiles is not None
            or batch.token_slots.shape[0] < self.plan_min_rows
        ):
            return
        batch.order, batch.tiles = self.plan_op(
            batch.token_slots, self.num_slots, lora_reference.LORA_PLAN_ROWS
        )
        self.planned += 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for g in self.groups.values() for t in (g.a, g.b_t))

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

    def _group_at(self, present: list[tuple[str, int, int]]) -> tuple[LoraGroup, int]:
        """The group whose targets `present` names, side by side in its order, and the first
        column; an error for any other layout (a wrong add otherwise)."""
        group = self.slots.groups.get((self.layer_idx, present[0][0]))
        start = present[0][1]
        layout = tuple((name, width) for name, _, width in present)
        contiguous = all(
            col == start + sum(w for _, _, w in present[:i])
            for i, (_, col, _) in enumerate(present)
        )
        if group is None or layout != tuple(zip(group.targets, group.widths)) or not contiguous:
            raise ValueError(
                f"layer {self.layer_idx}: LoRA targets {layout} at columns "
                f"{[c for _, c, _ in present]} are not one group's layout"
            )
        return group, start

    def project(
        self, ops: KernelOps, proj: nn.Module, x: torch.Tensor,
        targets: list[tuple[str, int, int]], act: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """`proj`'s output for `x` (with `act`, for `ops.silu_and_mul(x)`: a down
        projection) with the current forward's deltas of `targets` added (see `add`). Under
        device routing below the plan, with a linear op, for an `nn.Linear` whose output the
        targets' group covers: one `linear_op` call (on CUDA at few rows the expand runs in
        the GEMV's stores); otherwise the projection, then `add`."""
        slots, batch = self.slots, self.slots.batch
        present = [t for t in targets if (self.layer_idx, t[0]) in slots.shapes]
        if batch is not None and batch.groups is None and present:
            slots.plan(batch)
            if slots.linear_op is not None and batch.tiles is None and isinstance(proj, nn.Linear):
                group, start = self._group_at(present)
                if start == 0 and sum(group.widths) == proj.out_features:
                    slots.linear_calls += 1
                    counters = {} if slots.sync is None else {"sync": slots.sync}
                    return slots.linear_op(
                        x, proj.weight, proj.bias, group.a, group.b_t, batch.token_slots,
                        group.scales, group.widths, act=act, **counters,
                    )  # fmt: skip
        inp = ops.silu_and_mul(x) if act else x
        y = base_project(ops, proj, inp)
        self.add(inp, y, targets)
        return y

    def add(self, x: torch.Tensor, y: torch.Tensor, targets: list[tuple[str, int, int]]) -> None:
        """Add the deltas of `targets` — (name, first column, column count) of `y`, the
        (possibly fused) base output computed from `x` — for the current forward's rows.
        Under device routing the targets must be one group's, side by side in its order."""
        slots, batch = self.slots, self.slots.batch
        if batch is None:
            return
        present = [t for t in targets if (self.layer_idx, t[0]) in slots.shapes]
        if not present:
            return
        if batch.groups is None:
            slots.plan(batch)
            group, start = self._group_at(present)
            out = y[:, start : start + sum(group.widths)]
            if batch.tiles is not None and slots.tiles_op is not None:
                ordered = {} if batch.order is None else {"order": batch.order}
                slots.tiles_op(
                    out, x, group.a, group.b_t, batch.tiles, group.scales, group.widths, **ordered
                )
            else:
                counters = {} if slots.sync is None else {"sync": slots.sync}
                slots.gather_op(
                    out, x, group.a, group.b_t, batch.token_slots, group.scales, group.widths,
                    **counters,
                )  # fmt: skip
            return
        for name, start, width in present:
            key = (self.layer_idx, name)
            lora_segment_add(
                y[:, start : start + width], x, slots.a[key], slots.b_t[key], batch.groups,
                slots.ranks[key], slots.scales[key],
            )  # fmt: skip
