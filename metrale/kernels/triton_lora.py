"""Multi-LoRA on CUDA, over one group of targets that share their input (q/k/v, o, gate/up,
down): the gather form of `lora_reference.lora_gather_add` (each token row reads its adapter
through its slot), the tiled form of `lora_reference.lora_tiles_add` (each tile of rows of one
adapter reads it once, `tl.dot` tiles), and `lora_plan`, which groups a decode graph's rows by
slot on the device so the tiled form can serve it.

Owner: kernels. `lora_gather_add`, `lora_tiles_add` and `lora_plan` are the CUDA entries of
the `KernelOps` ops of the same names.

Forms of `lora_gather_add` (chosen by row count, `form="auto"`):
- split (more than `FUSED_MAX_ROWS` rows): a split-K shrink (`x @ A[slot, j].T` for every
  target j, float32 partial sums per K split) and an expand that sums the splits, scales by
  target and adds `xa_j @ B[slot, :, cols_j]` into each target's columns. The shrink's
  reduction over the input features is spread over `splits` programs per row instead of one
  program walking all of them.
- sync (one or two rows, batch-1 decode, `FEW_ROWS_FORM`; CUDA, with the caller's counters,
  and a grid within the SM count): one launch per group instead of two, each of a row's
  `SYNC_PROGRAMS` programs a K split of the shrink (one K tile: its A tile and its B block
  load before the PDL wait), then a grid barrier on the counters, then a column block of
  the expand. Every program is resident while it waits (the grid is at most the SM count,
  and a PDL dependent launches only once all of them have started).
- fused (the few-rows form where sync cannot run: no counters, the interpreter, a small
  GPU): one launch per group; each of a row's `FUSED_PROGRAMS` programs repeats the row's
  whole shrink (a pipelined walk over K: A of a rank-16 group is a few hundred KB, read from
  L2) and expands its share of the columns.
With PDL, the gather forms read A, B, the scales and the slot tensor before the wait for
the kernel launched just before (their latency then hides behind its tail): that kernel must
not write them. In a decode graph it cannot (the slot tensor is a graph input copied in
before the replay, the stacks change only between steps); x, y, the partials and the
counters are read only after the wait.
Many rows (a decode graph of `layers.lora.PLAN_MIN_ROWS` rows or more) go through
`lora_plan` + `lora_tiles_add(order=...)` instead, SGMV-like: a 64-row batch over 8 adapters
reads each adapter's weights once per 16-row tile, not once per row.

Invariants:
- Each op computes its reference (`lora_reference`): rows of slot -1 (or in no tile) are
  neither read nor written, the rank dimension is padded to a power of two and masked,
  accumulation is float32; an empty tile (count 0) reads and writes nothing.
- No host read of the slot tensor or of the plan: every launch depends only on shapes, so the
  ops can be captured in a CUDA graph with the slot tensor as a graph input.
- The sync form leaves its counters as it found them (zero): the last program through the
  barrier resets them, so stream-ordered calls (and graph replays) can share one buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from metrale.kernels.lora_reference import LORA_PLAN_ROWS as PLAN_ROWS
from metrale.kernels.lora_reference import LORA_TILE_ROWS as TILE_ROWS
from metrale.kernels.lora_reference import lora_plan_max_tiles
from metrale.kernels.triton_attention_common import (
    interpreting,
    multiprocessor_count,
    pdl_enter,
    pdl_options,
)

#: Input features per shrink program (a multiple of the K tile), and the most splits per row.
_K_PER_SPLIT = 256
_MAX_SPLITS = 64
#: `lora_gather_add` runs a one-launch form up to this many token rows (`FEW_ROWS_FORM`);
#: the fused form over `FUSED_PROGRAMS` programs per row (a trade: more programs spread the
#: expand, each repeats the shrink).
FUSED_MAX_ROWS = 2
FUSED_PROGRAMS = 16
#: The form "auto" runs up to `FUSED_MAX_ROWS` rows: "sync" where it can run (the caller's
#: counters `sync=`, CUDA, rows x `SYNC_PROGRAMS` within the SM count), else "fused";
#: "fused" here: always fused; "split": the two-kernel form at every row count.
FEW_ROWS_FORM = "sync"
#: Programs per row of the "sync" form (each a K split of the shrink, then a column block).
SYNC_PROGRAMS = 32
#: Polls of the "sync" form's barrier before a program gives up waiting (and flags it in
#: `sync[2]`): a bound so that a broken barrier fails a test instead of hanging the device.
SYNC_MAX_SPINS = 1 << 22


class _Geometry(NamedTuple):
    """The launch shape of one group op: targets, rank, feature counts, tile sizes, the K
    splits and the targets' column bounds."""

    targets: int
    rank: int
    fan_in: int
    fan_out: int
    block_r: int
    block_tr: int
    block_k: int
    splits: int
    k_per_split: int
    bounds: tuple[int, int]


def _geometry(
    op: str, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
    widths: tuple[int, ...], block_k: int | None, k_per_split: int, max_splits: int,
) -> _Geometry:  # fmt: skip
    """Check a group op's operands and lay out its launches (`block_k` None: 64 when the
    rank rows are many, else 128)."""
    targets, rank, fan_in = a.shape[1], a.shape[2], a.shape[3]
    fan_out = y.shape[1]
    if not 1 <= targets <= 3 or len(widths) != targets or sum(widths) != fan_out:
        raise ValueError(f"{op}: {targets} targets of widths {widths}, y has {fan_out}")
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(3) != 1 or b_t.stride(2) != 1:
        raise ValueError(f"{op} needs unit-stride rows (x, y, a, b_t)")
    block_r = max(16, triton.next_power_of_2(rank))
    block_tr = triton.next_power_of_2(targets) * block_r
    if block_k is None:
        block_k = 64 if block_tr >= 128 else 128
    splits = min(max_splits, triton.cdiv(fan_in, k_per_split))
    per_split = triton.cdiv(triton.cdiv(fan_in, splits), block_k) * block_k
    cum = [sum(widths[: j + 1]) for j in range(targets)] + [fan_out] * (3 - targets)
    return _Geometry(
        targets, rank, fan_in, fan_out, block_r, block_tr, block_k,
        triton.cdiv(fan_in, per_split), per_split, (cum[0], cum[1]),
    )  # fmt: skip


@triton.jit
def _lora_shrink(
    x_ptr, a_ptr, slots_ptr, part_ptr,
    K, R, k_per_split, stride_x, stride_as, stride_at, stride_ar,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    sp = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    jr = tl.arange(0, BLOCK_TR)
    j = jr // BLOCK_R
    r = jr % BLOCK_R
    row_mask = (j < T) & (r < R) & ((jr * 0 + slot) >= 0)  # base rows (slot -1) read nothing
    rows = a_ptr + s * stride_as + j.to(tl.int64) * stride_at + r.to(tl.int64) * stride_ar
    k_start = sp * k_per_split
    # The first A tile loads before the PDL wait (see `lora_gather_add`: nothing the kernel
    # before writes), so its latency hides behind that kernel's tail.
    k = k_start + tl.arange(0, BLOCK_K)
    k_mask = (k < K) & ((k * 0 + slot) >= 0)
    av = tl.load(rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    pdl_enter(PDL)
    xv = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
    acc = tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = (k < K) & ((k * 0 + slot) >= 0)
        xt = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        at = tl.load(
            rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += tl.sum(at * xt[None, :], axis=1)
    tl.store(part_ptr + (t * SPLITS + sp) * BLOCK_TR + jr, acc)


@triton.jit
def _lora_expand(
    part_ptr, b_ptr, slots_ptr, scales_ptr, y_ptr,
    N, R, n1, n2, stride_y, stride_bs, stride_br, stride_ss,
    T: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < R
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (n < N) & ((n * 0 + slot) >= 0)  # base rows (slot -1) are not written
    bv = tl.load(  # before the PDL wait, as the shrink's first A tile
        b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    pdl_enter(PDL)
    target = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)  # which target owns column n
    sp = tl.arange(0, SPLITS_P2)
    parts = part_ptr + (t * SPLITS + sp[:, None]) * BLOCK_TR + r[None, :]
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for jj in tl.static_range(T):
        p = tl.load(parts + jj * BLOCK_R, mask=(sp[:, None] < SPLITS) & r_mask[None, :], other=0.0)
        xa = tl.sum(p, axis=0) * tl.load(scales_ptr + s * stride_ss + jj)
        delta = tl.where(target == jj, tl.sum(bv * xa[:, None], axis=0), delta)
    ptr = y_ptr + t * stride_y + n
    yv = tl.load(ptr, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(ptr, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def lora_gather_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
    pdl: bool = False,
    form: str = "auto",
    fused_programs: int = FUSED_PROGRAMS,
    sync: torch.Tensor | None = None,
) -> None:
    """`lora_reference.lora_gather_add` (see there). `form`: "split" (the shrink and expand
    kernels), "fused" (one kernel: each of `fused_programs` programs per row repeats the row's
    shrink, then expands its share of the columns), "sync" (one kernel: `SYNC_PROGRAMS` per
    row, each a K split of the shrink, a grid barrier on the counters `sync`, then a column
    block of the expand; CUDA only), "auto" (`FEW_ROWS_FORM` up to `FUSED_MAX_ROWS` rows,
    else split). With `pdl` the kernels launch as programmatic dependents (the decode graph's
    chain, `PDL_OPS`). `sync`: int32 `[4]` zeros on the device, left zero by every call;
    calls sharing it must be stream-ordered."""
    tokens = x.shape[0]
    if tokens == 0:
        return
    if form not in ("auto", "split", "fused", "sync"):
        raise ValueError(f"lora_gather_add: form {form!r} is not auto, split, fused or sync")
    if form == "auto" and tokens <= FUSED_MAX_ROWS:
        form = FEW_ROWS_FORM
        if form == "sync" and not _sync_fits(x, sync):
            form = "fused"
    if form == "sync":
        if sync is None or sync.dtype != torch.int32 or sync.numel() < 4:
            raise ValueError("lora_gather_add: the sync form needs int32 counters `sync` [4]")
        g = _geometry("lora_gather_add", y, x, a, b_t, widths, None, _K_PER_SPLIT, _MAX_SPLITS)
        _lora_sync_add(y, x, a, b_t, token_slots, scales, g, sync, pdl)
        return
    if form == "fused":
        g = _geometry("lora_gather_add", y, x, a, b_t, widths, None, _K_PER_SPLIT, _MAX_SPLITS)
        _lora_fused_add(y, x, a, b_t, token_slots, scales, g, fused_programs, pdl)
        return
    g = _geometry("lora_gather_add", y, x, a, b_t, widths, None, _K_PER_SPLIT, _MAX_SPLITS)
    part = torch.empty(tokens, g.splits, g.block_tr, dtype=torch.float32, device=x.device)
    _lora_shrink[(tokens, g.splits)](
        x, a, token_slots, part, g.fan_in, g.rank, g.k_per_split, x.stride(0), a.stride(0),
        a.stride(1), a.stride(2),
        T=g.targets, SPLITS=g.splits, BLOCK_R=g.block_r, BLOCK_TR=g.block_tr, BLOCK_K=g.block_k,
        PDL=pdl, **pdl_options(pdl),
    )  # fmt: skip
    block_n = 128
    _lora_expand[(tokens, triton.cdiv(g.fan_out, block_n))](
        part, b_t, token_slots, scales, y, g.fan_out, g.rank, *g.bounds, y.stride(0),
        b_t.stride(0), b_t.stride(1), scales.stride(0),
        T=g.targets, SPLITS=g.splits, SPLITS_P2=triton.next_power_of_2(g.splits),
        BLOCK_R=g.block_r, BLOCK_TR=g.block_tr, BLOCK_N=block_n, PDL=pdl, **pdl_options(pdl),
    )  # fmt: skip


@triton.jit
def _lora_fused(
    x_ptr, a_ptr, b_ptr, slots_ptr, scales_ptr, y_ptr,
    K, N, R, n1, n2, cols_per_prog, stride_x, stride_as, stride_at, stride_ar, stride_y,
    stride_bs, stride_br, stride_ss,
    T: tl.constexpr, T_P2: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One launch per group for few rows: program (t, p) computes row t's whole shrink (every
    program of the row repeats it, reading A from L2) and then the expand of its
    `cols_per_prog` columns. The walk over K is software-pipelined (`STAGES`), its first A
    tile loaded before the PDL wait."""
    t = tl.program_id(0)
    pid = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    jr = tl.arange(0, BLOCK_TR)
    j = jr // BLOCK_R
    r = jr % BLOCK_R
    row_mask = (j < T) & (r < R) & ((jr * 0 + slot) >= 0)  # base rows (slot -1) read nothing
    rows = a_ptr + s * stride_as + j.to(tl.int64) * stride_at + r.to(tl.int64) * stride_ar
    k = tl.arange(0, BLOCK_K)
    k_mask = (k < K) & ((k * 0 + slot) >= 0)
    av = tl.load(rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    pdl_enter(PDL)
    xv = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
    acc = av.to(tl.float32) * xv[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = (k < K) & ((k * 0 + slot) >= 0)
        xt = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        at = tl.load(
            rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += at * xt[None, :]
    xa = tl.reshape(tl.sum(acc, axis=1), (T_P2, BLOCK_R))
    tj = tl.arange(0, T_P2)
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < R
    for n0 in range(0, cols_per_prog, BLOCK_N):
        n = pid * cols_per_prog + n0 + tl.arange(0, BLOCK_N)
        n_mask = (n < N) & ((n * 0 + slot) >= 0)  # base rows (slot -1) are not written
        bv = tl.load(
            b_ptr + s * stride_bs + rr[:, None] * stride_br + n[None, :],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        target = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)  # which target owns column n
        delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for jj in tl.static_range(T):
            xa_j = tl.sum(tl.where(tj[:, None] == jj, xa, 0.0), axis=0)
            xa_j = xa_j * tl.load(scales_ptr + s * stride_ss + jj)
            delta = tl.where(target == jj, tl.sum(bv * xa_j[:, None], axis=0), delta)
        ptr = y_ptr + t * stride_y + n
        yv = tl.load(ptr, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(ptr, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _lora_fused_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
    token_slots: torch.Tensor, scales: torch.Tensor, g: _Geometry, programs: int, pdl: bool,
) -> None:  # fmt: skip
    block_n = 256
    block_k = min(256, max(32, 8192 // g.block_tr))  # the [rank rows, K] tile: 32 floats a thread
    cols_per_prog = triton.cdiv(triton.cdiv(g.fan_out, programs), block_n) * block_n
    _lora_fused[(x.shape[0], triton.cdiv(g.fan_out, cols_per_prog))](
        x, a, b_t, token_slots, scales, y, g.fan_in, g.fan_out, g.rank, *g.bounds,
        cols_per_prog, x.stride(0), a.stride(0), a.stride(1), a.stride(2), y.stride(0),
        b_t.stride(0), b_t.stride(1), scales.stride(0),
        T=g.targets, T_P2=g.block_tr // g.block_r, BLOCK_R=g.block_r, BLOCK_TR=g.block_tr,
        BLOCK_K=block_k, BLOCK_N=block_n, STAGES=3, PDL=pdl, num_warps=8, **pdl_options(pdl),
    )  # fmt: skip


@triton.jit
def _lora_sync(
    x_ptr, a_ptr, b_ptr, slots_ptr, scales_ptr, y_ptr, part_ptr, sync_ptr,
    K, N, R, n1, n2, k_per_split, stride_x, stride_as, stride_at, stride_ar, stride_y,
    stride_bs, stride_br, stride_ss, max_spins,
    T: tl.constexpr, T_P2: tl.constexpr, P: tl.constexpr, P_P2: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One launch per group: program (t, p) sums row t's shrink over its K split into
    `part[t, p]`, waits on a grid barrier (every program of the launch is resident: the grid
    is at most the SM count), sums the row's P partials and expands column block p. B is
    loaded before the barrier, so its latency overlaps the wait, and (with the first A tile)
    before the PDL wait. The last program through the barrier resets the counters for the
    next call."""
    t = tl.program_id(0)
    pid = tl.program_id(1)
    total = tl.num_programs(0) * tl.num_programs(1)
    slot = tl.load(slots_ptr + t)
    s = tl.maximum(slot, 0).to(tl.int64)
    jr = tl.arange(0, BLOCK_TR)
    j = jr // BLOCK_R
    r = jr % BLOCK_R
    row_mask = (j < T) & (r < R) & ((jr * 0 + slot) >= 0)  # base rows (slot -1) read nothing
    rows = a_ptr + s * stride_as + j.to(tl.int64) * stride_at + r.to(tl.int64) * stride_ar
    k_start = pid * k_per_split
    k = k_start + tl.arange(0, BLOCK_K)
    k_mask = (k < K) & ((k * 0 + slot) >= 0)
    av = tl.load(rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    rr = tl.arange(0, BLOCK_R)
    r_mask = rr < R
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = (n < N) & ((n * 0 + slot) >= 0)  # base rows (slot -1) are not written
    bv = tl.load(
        b_ptr + s * stride_bs + rr[:, None] * stride_br + n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    pdl_enter(PDL)  # x, y, the partials and the counters are the chain's: only after it
    xv = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
    acc = av.to(tl.float32) * xv[None, :]
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = (k < K) & ((k * 0 + slot) >= 0)
        xt = tl.load(x_ptr + t * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        at = tl.load(
            rows[:, None] + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        acc += at * xt[None, :]
    tl.store(part_ptr + (t * P + pid) * BLOCK_TR + jr, tl.sum(acc, axis=1))
    # The grid barrier: every thread's partial stored, then one release arrival, polls with
    # acquire until all have arrived (bounded: a timeout is flagged in sync[2], not hung).
    tl.debug_barrier()
    arrived = tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu") + 1
    spins = 0
    while (arrived < total) & (spins < max_spins):
        arrived = tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if arrived < total:
        tl.atomic_xchg(sync_ptr + 2, 1)
    left = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == total - 1:  # every program is past the wait: reset for the next call
        tl.atomic_xchg(sync_ptr, 0)
        tl.atomic_xchg(sync_ptr + 1, 0)
    tl.debug_barrier()
    sp = tl.arange(0, P_P2)
    parts = tl.load(
        part_ptr + (t * P + sp[:, None]) * BLOCK_TR + jr[None, :],
        mask=(sp[:, None] < P) & (jr[None, :] >= 0),
        other=0.0,
        cache_modifier=".cg",  # written by other SMs: not through this SM's L1
    )
    xa = tl.reshape(tl.sum(parts, axis=0), (T_P2, BLOCK_R))
    tj = tl.arange(0, T_P2)
    target = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)  # which target owns column n
    bf = bv.to(tl.float32)
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for jj in tl.static_range(T):
        xa_j = tl.sum(tl.where(tj[:, None] == jj, xa, 0.0), axis=0)
        xa_j = xa_j * tl.load(scales_ptr + s * stride_ss + jj)
        delta = tl.where(target == jj, tl.sum(bf * xa_j[:, None], axis=0), delta)
    ptr = y_ptr + t * stride_y + n
    yv = tl.load(ptr, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(ptr, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _sync_fits(x: torch.Tensor, sync: torch.Tensor | None) -> bool:
    """Whether the sync form can run `x`'s rows: counters given, compiled CUDA, and the grid
    (rows x `SYNC_PROGRAMS`) within the SM count, so every program is resident at once."""
    return (
        sync is not None
        and x.device.type == "cuda"
        and not interpreting()
        and x.shape[0] * SYNC_PROGRAMS <= multiprocessor_count(x.device)
    )


def _lora_sync_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
    token_slots: torch.Tensor, scales: torch.Tensor, g: _Geometry, sync: torch.Tensor,
    pdl: bool,
) -> None:  # fmt: skip
    if x.device.type != "cuda":
        raise ValueError(
            "lora_gather_add: the sync form needs CUDA (its programs must be resident)"
        )
    tokens = x.shape[0]
    if tokens * SYNC_PROGRAMS > multiprocessor_count(x.device):
        raise ValueError(
            f"lora_gather_add: the sync form's {tokens} x {SYNC_PROGRAMS} programs exceed the SMs"
        )
    launch_sync(y, x, a, b_t, token_slots, scales, g, sync, pdl)


def launch_sync(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor,
    token_slots: torch.Tensor, scales: torch.Tensor, g: _Geometry, sync: torch.Tensor,
    pdl: bool,
) -> None:  # fmt: skip
    """The sync kernel's launch, unchecked (`tests/gpu/compile_sm90.py` compiles it on CPU)."""
    tokens = x.shape[0]
    programs = SYNC_PROGRAMS
    # one K tile per program where it fits in 64 float32 a thread (Qwen3-8B at rank 16: all)
    block_k = min(
        max(32, 16384 // g.block_tr), triton.next_power_of_2(triton.cdiv(g.fan_in, programs))
    )
    k_per_split = triton.cdiv(triton.cdiv(g.fan_in, programs), block_k) * block_k
    block_n = triton.next_power_of_2(triton.cdiv(g.fan_out, programs))
    part = torch.empty(tokens, programs, g.block_tr, dtype=torch.float32, device=x.device)
    _lora_sync[(tokens, programs)](
        x, a, b_t, token_slots, scales, y, part, sync, g.fan_in, g.fan_out, g.rank, *g.bounds,
        k_per_split, x.stride(0), a.stride(0), a.stride(1), a.stride(2), y.stride(0),
        b_t.stride(0), b_t.stride(1), scales.stride(0), SYNC_MAX_SPINS,
        T=g.targets, T_P2=g.block_tr // g.block_r, P=programs,
        P_P2=triton.next_power_of_2(programs), BLOCK_R=g.block_r, BLOCK_TR=g.block_tr,
        BLOCK_K=block_k, BLOCK_N=block_n, PDL=pdl, num_warps=8, **pdl_options(pdl),
    )  # fmt: skip


@triton.jit
def _lora_tile_rows(order_ptr, start, count, BLOCK_M: tl.constexpr, ORDERED: tl.constexpr):
    """A tile's token rows (int64) and their mask: `order[start + m]` or `start + m`."""
    m = tl.arange(0, BLOCK_M)
    m_mask = m < count
    if ORDERED:
        rows = tl.load(order_ptr + start + m, mask=m_mask, other=0).to(tl.int64)
    else:
        rows = (start + m).to(tl.int64)
    return rows, m_mask


@triton.jit
def _lora_tile_shrink(
    x_ptr, a_ptr, tiles_ptr, order_ptr, part_ptr,
    K, R, k_per_split, stride_x, stride_as, stride_at, stride_ar,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    tile = tl.program_id(0)
    sp = tl.program_id(1)
    start = tl.load(tiles_ptr + tile * 3)
    count = tl.load(tiles_ptr + tile * 3 + 1)
    s = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    rows, m_mask = _lora_tile_rows(order_ptr, start, count, BLOCK_M, ORDERED)
    rows_x = x_ptr + rows * stride_x
    jr = tl.arange(0, BLOCK_TR)
    j = jr // BLOCK_R
    r = jr % BLOCK_R
    jr_mask = (j < T) & (r < R) & ((jr * 0 + count) > 0)  # an empty tile reads nothing
    rows_a = a_ptr + s * stride_as + j.to(tl.int64) * stride_at + r.to(tl.int64) * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_TR), dtype=tl.float32)
    k_start = sp * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xv = tl.load(
            rows_x[:, None] + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        av = tl.load(
            rows_a[:, None] + k[None, :], mask=jr_mask[:, None] & k_mask[None, :], other=0.0
        )
        # float32 operands: a bf16/fp16 value is exact in tf32, so tf32 products of them are
        # exact too (and Triton's interpreter, which has no bf16 dot, runs the same code)
        xf, af = xv.to(tl.float32), tl.trans(av.to(tl.float32))
        if IEEE:
            acc += tl.dot(xf, af, input_precision="ieee")
        else:
            acc += tl.dot(xf, af, input_precision="tf32")
    out = part_ptr + (rows[:, None] * SPLITS + sp) * BLOCK_TR + jr[None, :]
    tl.store(out, acc, mask=m_mask[:, None])


@triton.jit
def _lora_tile_expand(
    part_ptr, b_ptr, tiles_ptr, order_ptr, scales_ptr, y_ptr,
    N, R, n1, n2, stride_y, stride_bs, stride_br, stride_ss,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_TR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, ORDERED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(PDL)
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    start = tl.load(tiles_ptr + tile * 3)
    count = tl.load(tiles_ptr + tile * 3 + 1)
    s = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int64)
    tokens, m_mask = _lora_tile_rows(order_ptr, start, count, BLOCK_M, ORDERED)
    r = tl.arange(0, BLOCK_R)
    r_mask = (r < R) & ((r * 0 + count) > 0)  # an empty tile reads nothing
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    bv = tl.load(
        b_ptr + s * stride_bs + r[:, None] * stride_br + n[None, :],
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    target = (n >= n1).to(tl.int32) + (n >= n2).to(tl.int32)
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for jj in tl.static_range(T):
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for sp in range(SPLITS):
            xa += tl.load(
                part_ptr + (tokens[:, None] * SPLITS + sp) * BLOCK_TR + jj * BLOCK_R + r[None, :],
                mask=m_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
        xa = xa * tl.load(scales_ptr + s * stride_ss + jj)
        if IEEE:
            dj = tl.dot(xa, bv.to(tl.float32), input_precision="ieee")
        else:  # xa rounded to the weights' dtype first, as the reference does
            dj = tl.dot(xa.to(bv.dtype).to(tl.float32), bv.to(tl.float32), input_precision="tf32")
        delta = tl.where(target[None, :] == jj, dj, delta)
    ptr = y_ptr + tokens[:, None] * stride_y + n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    yv = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (yv + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_tiles_add(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    tiles: torch.Tensor,
    scales: torch.Tensor,
    widths: tuple[int, ...],
    order: torch.Tensor | None = None,
    pdl: bool = False,
) -> None:
    """`lora_reference.lora_tiles_add` (see there): per tile of token rows of one adapter (at
    most `LORA_TILE_ROWS` of them, or `LORA_PLAN_ROWS` through `order`), a split-K shrink and
    an expand, each one `tl.dot` per tile, so the tile reads its adapter's A and B once rather
    than once per token. Empty tiles (count 0) read and write nothing. The launch depends only
    on the shapes (capturable with `lora_plan`'s outputs as inputs). With `pdl` both kernels
    launch as programmatic dependents (`PDL_OPS`)."""
    num_tiles = tiles.shape[0]
    if num_tiles == 0 or x.shape[0] == 0:
        return
    g = _geometry("lora_tiles_add", y, x, a, b_t, widths, 64, 2 * _K_PER_SPLIT, _MAX_SPLITS // 4)
    ieee = x.dtype == torch.float32
    ordered = order is not None
    block_m = PLAN_ROWS if ordered else TILE_ROWS
    part = torch.empty(x.shape[0], g.splits, g.block_tr, dtype=torch.float32, device=x.device)
    _lora_tile_shrink[(num_tiles, g.splits)](
        x, a, tiles, order if ordered else tiles, part, g.fan_in, g.rank, g.k_per_split,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2),
        T=g.targets, SPLITS=g.splits, BLOCK_M=block_m, BLOCK_R=g.block_r,
        BLOCK_TR=g.block_tr, BLOCK_K=g.block_k, IEEE=ieee, ORDERED=ordered, PDL=pdl,
        **pdl_options(pdl),
    )  # fmt: skip
    block_n = 64
    _lora_tile_expand[(num_tiles, triton.cdiv(g.fan_out, block_n))](
        part, b_t, tiles, order if ordered else tiles, scales, y, g.fan_out, g.rank, *g.bounds,
        y.stride(0), b_t.stride(0), b_t.stride(1), scales.stride(0),
        T=g.targets, SPLITS=g.splits, BLOCK_M=block_m, BLOCK_R=g.block_r,
        BLOCK_TR=g.block_tr, BLOCK_N=block_n, IEEE=ieee, ORDERED=ordered, PDL=pdl,
        **pdl_options(pdl),
    )  # fmt: skip


@triton.jit
def _lora_plan(
    slots_ptr, order_ptr, tiles_ptr, T, max_tiles,
    NUM_SLOTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_TILES: tl.constexpr,
):  # fmt: skip
    """One program: a counting sort of the rows by slot (bucket NUM_SLOTS: the base rows),
    then the tile table (see `lora_reference.lora_plan`)."""
    b = tl.arange(0, BLOCK_S)
    counts = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        sv = tl.load(slots_ptr + t, mask=t < T, other=0).to(tl.int32)
        bucket = tl.where(t < T, tl.where(sv < 0, NUM_SLOTS, sv), BLOCK_S)  # past T: none
        counts += tl.sum((bucket[:, None] == b[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    seen = tl.zeros((BLOCK_S,), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        sv = tl.load(slots_ptr + t, mask=t < T, other=0).to(tl.int32)
        bucket = tl.where(t < T, tl.where(sv < 0, NUM_SLOTS, sv), BLOCK_S)
        hot = (bucket[:, None] == b[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot  # earlier rows of the same bucket in this chunk
        pos = tl.sum(hot * ((starts + seen)[None, :] + before), axis=1)
        tl.store(order_ptr + pos, t, mask=t < T)
        seen += tl.sum(hot, axis=0)
    ntiles = tl.where(b < NUM_SLOTS, (counts + BLOCK_M - 1) // BLOCK_M, 0)
    tstart = tl.cumsum(ntiles, axis=0) - ntiles
    i = tl.arange(0, BLOCK_TILES)
    hit = ((i[:, None] >= tstart[None, :]) & (i[:, None] < (tstart + ntiles)[None, :])).to(tl.int32)
    has = tl.sum(hit, axis=1) > 0
    j = i - tl.sum(hit * tstart[None, :], axis=1)
    first = tl.sum(hit * starts[None, :], axis=1) + j * BLOCK_M
    count = tl.minimum(tl.sum(hit * counts[None, :], axis=1) - j * BLOCK_M, BLOCK_M)
    slot = tl.sum(hit * b[None, :], axis=1)
    live = i < max_tiles
    tl.store(tiles_ptr + i * 3, tl.where(has, first, 0), mask=live)
    tl.store(tiles_ptr + i * 3 + 1, tl.where(has, count, 0), mask=live)
    tl.store(tiles_ptr + i * 3 + 2, tl.where(has, slot, 0), mask=live)


def lora_plan(
    token_slots: torch.Tensor, num_slots: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_reference.lora_plan` (see there) in one single-program launch: no host read, the
    outputs' sizes fixed by the shapes, so a decode graph captures it with the slot tensor as
    its input. Slots must lie in `[-1, num_slots)` (not checked on the device)."""
    tokens = token_slots.shape[0]
    max_tiles = lora_plan_max_tiles(tokens, num_slots, block_m)
    order = torch.empty(tokens, dtype=torch.int32, device=token_slots.device)
    tiles = torch.empty(max_tiles, 3, dtype=torch.int32, device=token_slots.device)
    if tokens == 0:
        return order, tiles
    _lora_plan[(1,)](
        token_slots, order, tiles, tokens, max_tiles,
        NUM_SLOTS=num_slots, BLOCK_S=triton.next_power_of_2(num_slots + 1),
        BLOCK_T=min(128, triton.next_power_of_2(tokens)), BLOCK_M=block_m,
        BLOCK_TILES=triton.next_power_of_2(max_tiles),
    )  # fmt: skip
    return order, tiles
