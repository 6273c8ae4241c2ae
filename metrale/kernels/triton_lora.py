"""Multi-LoRA on CUDA, over one group of targets that share their input (q/k/v, o, gate/up,
down): the gather form of `lora_reference.lora_gather_add` (each token row reads its adapter
through its slot). The tiled form and the device plan that groups rows by slot are in
`triton_lora_tiles` (`lora_tiles_add`, `lora_plan`).

Owner: kernels. `lora_gather_add` is the CUDA entry of the `KernelOps` op of the same name.

Forms of `lora_gather_add` (chosen by row count, `form="auto"`):
- epilogue (`FEW_ROWS_FORM`, the default: not a form of this op but of the projection it
  follows, `triton_linear.lora_linear`): where the base projection runs the GEMV, the
  split form's shrink launches first and the GEMV adds the expand as it stores
  (`triton_lora_epilogue`), one launch fewer per group. This op alone then runs split.
- split (every row count without the epilogue; measured fastest of this op's forms on the
  H200): a split-K shrink (`x @ A[slot, j].T` for every
  target j, float32 partial sums per K split) and an expand that sums the splits, scales by
  target and adds `xa_j @ B[slot, :, cols_j]` into each target's columns. The shrink's
  reduction over the input features is spread over `splits` programs per row instead of one
  program walking all of them.
- sync (opt-in for one or two rows, `FEW_ROWS_FORM = "sync"`; CUDA, with the caller's counters,
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
`triton_lora_tiles.lora_plan` + `lora_tiles_add(order=...)` instead, SGMV-like: a 64-row batch over 8 adapters
reads each adapter's weights once per 16-row tile, not once per row.

Invariants:
- Each form computes `lora_reference.lora_gather_add`: rows of slot -1 are neither read nor
  written, the rank dimension is padded to a power of two and masked, accumulation is
  float32.
- No host read of the slot tensor: every launch depends only on shapes, so the op can be
  captured in a CUDA graph with the slot tensor as a graph input.
- The sync form leaves its counters as it found them (zero): the last program through the
  barrier resets them, so stream-ordered calls (and graph replays) can share one buffer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import (
    interpreting,
    multiprocessor_count,
    pdl_enter,
    pdl_options,
)
from metrale.kernels.triton_gemv_tiles import _load_x

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
#: "fused" here: always fused; "split": the two-kernel form at every row count. Of these,
#: "split" measured fastest on the H200 (Qwen3-8B shapes, rank 16, one row, us per layer of
#: four group ops: split 22.5, sync 33.3, fused/32 104.6, fused/16 127.9; record
#: `bench/records/20261202T011500-lora-kernels-qwen3-8b.json`). "epilogue": "split" here,
#: and `triton_linear.lora_linear` folds the expand into the base GEMV wherever the GEMV
#: runs the projection (`tools/bench_lora_kernels.py` times whole groups, "group/epilogue"
#: against "group/split").
FEW_ROWS_FORM = "epilogue"
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
    K, R, k_per_split, half, stride_x, stride_as, stride_at, stride_ar,
    T: tl.constexpr, SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TR: tl.constexpr,
    BLOCK_K: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Grid `(rows, SPLITS)`: `part[t, sp, j * BLOCK_R + r] = sum over split sp's K range of
    A[slot_t, j, r, k] * x[t, k]` (zeros for base rows, whose A is never read). With ACT, x
    is `silu(gate) * up` of a gate/up row (up `half` elements after gate), computed while
    loading as the GEMV computes it (`triton_gemv_tiles._load_x`): the epilogue form's
    down-projection shrink (`triton_lora_epilogue.lora_shrink`)."""
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
    pdl_enter(PDL)  # x is the chain's: only after the wait
    x_row = x_ptr + t * stride_x
    xv = _load_x(x_row + k, k_mask, half, False, ACT)
    acc = tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    for k0 in range(BLOCK_K, k_per_split, BLOCK_K):
        k = k_start + k0 + tl.arange(0, BLOCK_K)
        k_mask = (k < K) & ((k * 0 + slot) >= 0)
        xt = _load_x(x_row + k, k_mask, half, False, ACT)
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
    split for "epilogue", which only `triton_linear.lora_linear` can run; else split). With `pdl` the kernels launch as programmatic dependents (the decode graph's
    chain, `PDL_OPS`). `sync`: int32 `[4]` zeros on the device, left zero by every call;
    calls sharing it must be stream-ordered."""
    tokens = x.shape[0]
    if tokens == 0:
        return
    if form not in ("auto", "split", "fused", "sync"):
        raise ValueError(f"lora_gather_add: form {form!r} is not auto, split, fused or sync")
    if form == "auto" and tokens <= FUSED_MAX_ROWS:
        form = "split" if FEW_ROWS_FORM == "epilogue" else FEW_ROWS_FORM
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
        x, a, token_slots, part, g.fan_in, g.rank, g.k_per_split, 0, x.stride(0), a.stride(0),
        a.stride(1), a.stride(2),
        T=g.targets, SPLITS=g.splits, BLOCK_R=g.block_r, BLOCK_TR=g.block_tr, BLOCK_K=g.block_k,
        ACT=False, PDL=pdl, **pdl_options(pdl),
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
