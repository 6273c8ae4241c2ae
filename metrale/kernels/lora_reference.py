"""Multi-LoRA's torch references: the per-row slot gather (capturable) and the host-routed
tiles, each adding the LoRA deltas of one group of targets that share an input.

Owner: kernels (the CPU ops; `triton_lora.py` computes the same functions on CUDA, tested
against these in `tests/gpu/test_lora_kernels.py`).

Invariants:
- Rows of slot -1 (gather) or in no tile (tiles) are neither read nor written.
- `x @ A.T` is kept in float32 and scaled, then rounded to the weights' dtype before `@ B`.
"""

from __future__ import annotations

import torch


def lora_gather_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
) -> None:
    """Multi-LoRA by gather (capturable: no host read) over one group of T targets that share
    the input `x`: for every token row t with `s = token_slots[t] >= 0` and each target j,
    `y[t, cols_j] += ((a[s, j] @ x[t]) * scales[s, j]) @ b_t[s, :, cols_j]`, where the targets'
    column ranges `cols_j` lie side by side with `widths`; rows with slot -1 are untouched.
    `a` `[slots, T, R, in]`, `b_t` `[slots, R, sum(widths)]` (rows past an adapter's rank are
    zero), `scales` `[slots, T]` float32; `y` may be a column slice."""
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


#: Most token rows of one tile of `lora_tiles_add` (the Triton kernel's row tile; the routing
#: cuts each sequence's rows into tiles of at most this many, `metrale.layers.lora`).
LORA_TILE_ROWS = 32


def lora_tiles_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
) -> None:
    """`lora_gather_add` over the token rows named by `tiles` (`[n, 3]` int32: first row,
    row count, slot; every row of a tile uses that slot, rows in no tile are untouched): the
    routing an eager forward knows on the host, each tile one pair of small GEMMs."""
    for first, count, slot in tiles.tolist():
        rows = slice(first, first + count)
        col = 0
        for j, width in enumerate(widths):
            xa = (x[rows] @ a[slot, j].T).float() * scales[slot, j]
            delta = xa.to(b_t.dtype) @ b_t[slot, :, col : col + width]
            y[rows, col : col + width] += delta.to(y.dtype)
            col += width
