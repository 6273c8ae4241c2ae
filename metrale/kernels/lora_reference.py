"""Multi-LoRA's torch references: the per-row slot gather (capturable), the tiles (routed on the
host, or planned on the device by `lora_plan` over rows grouped by slot), each adding the LoRA
deltas of one group of targets that share an input.

Owner: kernels (the CPU ops; `triton_lora.py` and `triton_lora_tiles.py` compute the same functions on CUDA, tested
against these in `tests/gpu/test_lora_kernels.py`).

Invariants:
- Rows of slot -1 (gather) or in no tile (tiles) are neither read nor written.
- `lora_plan` is a pure function of the slot tensor: rows sorted by slot (stable; base rows
  last), cut into tiles of at most `block_m` rows of one slot, padded with empty tiles to a
  count that depends only on the shapes (`lora_plan_max_tiles`), so its Triton form can be
  captured in a CUDA graph.
- `x @ A.T` is kept in float32 and scaled, then rounded to the weights' dtype before `@ B`.
- `lora_linear` is the base projection, then `lora_gather_add` on its output (peft's order:
  base, then delta); with `act`, both read `reference.silu_and_mul` of the gate/up rows.
"""

from __future__ import annotations

import torch

from metrale.kernels import reference


def lora_gather_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
    sync: torch.Tensor | None = None,
) -> None:
    """Multi-LoRA by gather (capturable: no host read) over one group of T targets that share
    the input `x`: for every token row t with `s = token_slots[t] >= 0` and each target j,
    `y[t, cols_j] += ((a[s, j] @ x[t]) * scales[s, j]) @ b_t[s, :, cols_j]`, where the targets'
    column ranges `cols_j` lie side by side with `widths`; rows with slot -1 are untouched.
    `a` `[slots, T, R, in]`, `b_t` `[slots, R, sum(widths)]` (rows past an adapter's rank are
    zero), `scales` `[slots, T]` float32; `y` may be a column slice. `sync`: the CUDA
    kernel's barrier counters (`triton_lora.lora_gather_add`), unused here."""
    valid = token_slots >= 0
    safe = token_slots.clamp(min=0)
    b_rows = b_t.index_select(0, safe)
    start = 0
    for j, width in enumerate(widths):
        xa = torch.bmm(a[:, j].index_select(0, safe), x.unsqueeze(-1)).squeeze(-1).float()
        xa = xa * (scales[:, j].index_select(0, safe) * valid).unsqueeze(-1)
        cols = b_rows[:, :, start : start + width]
        delta = torch.bmm(xa.to(b_t.dtype).unsqueeze(1), cols).squeeze(1)
        y[:, start : start + width] += delta.to(y.dtype)
        start += width


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b_t: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
    *,
    act: bool = False,
    sync: torch.Tensor | None = None,
) -> torch.Tensor:
    """A base projection with the LoRA deltas of the one group whose targets cover all its
    output columns: `y = linear(x, weight, bias)`, then `lora_gather_add(y, x, ...)`; with
    `act` (a down projection) x is the gate/up rows and both read `silu_and_mul(x)`. What
    the CUDA op (`triton_linear.lora_linear`) does in two launches at few rows: the shrink,
    then the GEMV adding each row's delta as it stores. `sync`: unused here."""
    inp = reference.silu_and_mul(x) if act else x
    y = reference.linear(inp, weight, bias)
    lora_gather_add(y, inp, a, b_t, token_slots, scales, widths)
    return y


#: Most token rows of one tile of `lora_tiles_add` (the Triton kernel's row tile; the routing
#: cuts each sequence's rows into tiles of at most this many, `metrale.layers.lora`).
LORA_TILE_ROWS = 32
#: Most token rows of one tile of `lora_plan` (the rows of a decode graph grouped by slot on
#: the device: a few rows per adapter, so the smallest `tl.dot` tile).
LORA_PLAN_ROWS = 16


def lora_tiles_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
    order: torch.Tensor | None = None,
) -> None:
    """`lora_gather_add` over the token rows named by `tiles` (`[n, 3]` int32: first row,
    row count, slot; every row of a tile uses that slot, rows in no tile are untouched): the
    routing an eager forward knows on the host, each tile one pair of small GEMMs. With
    `order` (`lora_plan`), a tile's rows are `order[first : first + count]` instead of
    `first .. first + count - 1`; tiles of count 0 do nothing."""
    for first, count, slot in tiles.tolist():
        if count == 0:
            continue
        rows: slice | torch.Tensor = slice(first, first + count)
        if order is not None:
            rows = order[first : first + count]
        col = 0
        for j, width in enumerate(widths):
            xa = (x[rows] @ a[slot, j].T).float() * scales[slot, j]
            delta = xa.to(b_t.dtype) @ b_t[slot, :, col : col + width]
            y[rows, col : col + width] += delta.to(y.dtype)
            col += width


def lora_plan_max_tiles(tokens: int, num_slots: int, block_m: int) -> int:
    """The tile count of `lora_plan` for `tokens` rows over `num_slots` slots: the most any
    slot assignment needs (each slot present wastes at most one partial tile)."""
    return tokens // block_m + min(num_slots, tokens)


def lora_plan(
    token_slots: torch.Tensor, num_slots: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group token rows by slot on the device (what a captured decode graph can run: shapes
    alone fix the outputs' sizes). Returns `order` `[tokens]` int32, the rows sorted by slot
    (stable; rows of slot -1 last), and `tiles` `[lora_plan_max_tiles(...), 3]` int32 for
    `lora_tiles_add(..., order=order)`: per slot in increasing order, its rows cut into runs
    of `block_m` (first index into `order`, row count, slot), then empty tiles `(0, 0, 0)`.
    Slots must lie in `[-1, num_slots)`."""
    tokens = token_slots.shape[0]
    slots = token_slots.long()
    if tokens and (int(slots.min()) < -1 or int(slots.max()) >= num_slots):
        raise ValueError(f"lora_plan: slots outside [-1, {num_slots}): {slots.tolist()}")
    bucket = torch.where(slots < 0, num_slots, slots)
    order = torch.sort(bucket, stable=True).indices.to(torch.int32)
    counts = torch.bincount(bucket, minlength=num_slots + 1)[:num_slots].tolist()
    tiles: list[tuple[int, int, int]] = []
    first = 0
    for slot, count in enumerate(counts):
        tiles += [(first + i, min(block_m, count - i), slot) for i in range(0, count, block_m)]
        first += count
    total = lora_plan_max_tiles(tokens, num_slots, block_m)
    tiles += [(0, 0, 0)] * (total - len(tiles))
    out = torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3)
    return order.to(token_slots.device), out.to(token_slots.device)
