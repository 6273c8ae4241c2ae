"""Top-k / min-p / top-p filtering with the inverse-CDF draw, on the device and without
sorting the vocabulary: the sampler's draw for batches the torch path would fully sort.

Owner: kernels. `reference.top_k_top_p_sample` / `reference.top_k_top_p_filter` define the
functions; `tests/gpu/test_kernels.py` checks the kernels against them (forcing several
slices per row). `triton_sampling` re-exports both; the sampler decides when to call them.

Invariants:
- No host synchronisation; every output element is written.
- `top_k_top_p_sample` takes already processed float logits (penalties, bias, temperature,
  NaN -> -inf) and applies, per row and in this order: top-k (every logit >= the k-th largest
  stays), softmax, min-p (probabilities >= min_p * max), top-p (a token stays while the mass
  ranked above it, ties ranked by id, is < top_p * the remaining mass; masses are summed in
  float64: over a 152k vocabulary float32 sums in two different orders disagree about which
  token crosses the bound), then draws the first token in id order whose float64 cumulative
  probability reaches `u * total`. Thresholds are found exactly by a 16-way search over the
  order-preserving integer keys of the float32 logits (8 passes per threshold), not by
  sorting.
- Each row is split into `slices` contiguous ranges of whole chunks, one program each (grid
  `(rows, slices)`, about two programs per multiprocessor in all), and the work is a fixed
  sequence of launches (graph-safe): slice statistics; 8 top-k counting passes; the
  normaliser; the top-p total, 8 mass passes and the boundary ties; the surviving mass; the
  draw. A launch reduces the previous launch's per-slice partials itself, in slice order,
  so every program of a row derives the same row values, and slice 0 stores the ones later
  launches read. A search pass stores its state in slot `t % 2` and reads slot `(t - 1) % 2`.
- Tie ranks and the cumulative mass run across slices in id order (a slice adds the ties
  and mass of the slices before it), so the split changes no token: only the order of the
  float64 additions, as any two summation orders do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_attention_common import multiprocessor_count
from metrale.kernels.triton_key_search import (
    PASSES,
    PIVOTS,
    from_order_key,
    order_key,
    pivots,
    store_state,
    top_k_search,
    top_p_search,
)


@triton.jit
def _load_row(base, cols, V):
    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return tl.where(x != x, float("-inf"), x)


#: Elements per chunk of the draw kernels' loops; a slice of a row is whole chunks.
_CHUNK = 256
#: Most slices one row is split into (the per-slice partials are loaded as one vector).
_MAX_SLICES = 256
#: Columns of the per-row scalars one kernel hands the next: the top-k threshold key and the
#: top-p boundary key.
_T_K = tl.constexpr(0)
_K_B = tl.constexpr(1)


@triton.jit
def _row_stats(pmax_ptr, pkmin_ptr, row, S, SP: tl.constexpr):
    """`(m, key_min, key_max, samplable)` of a row from its slices' partials: the largest
    logit (0 when the row has no finite one), and the int64 key range of its logits."""
    offs = tl.arange(0, SP)
    mask = offs < S
    m = tl.max(tl.load(pmax_ptr + row * S + offs, mask=mask, other=float("-inf")), 0)
    kmin = tl.load(pkmin_ptr + row * S + offs, mask=mask, other=2147483647)
    key_min = tl.min(kmin, 0).to(tl.int64)
    samplable = m > float("-inf")
    key_max = order_key(m).to(tl.int64)
    return tl.where(samplable, m, 0.0), key_min, key_max, samplable


@triton.jit
def _top_p_row(top_p_ptr, pmax_ptr, pkmin_ptr, row, S, SP: tl.constexpr):
    """Row `row`'s top-p (float32), its `_row_stats` `(m, key_min, key_max)`, and whether its
    top-p pass runs (top-p below 1 and the row samplable)."""
    top_p = tl.load(top_p_ptr + row).to(tl.float32)
    m, key_min, key_max, samplable = _row_stats(pmax_ptr, pkmin_ptr, row, S, SP)
    return top_p, m, key_min, key_max, (top_p < 1.0) & samplable


@triton.jit
def _row_sum(ptr, row, S, SP: tl.constexpr):
    """The sum of a row's per-slice partials `ptr[row, :S]`, in one fixed order."""
    offs = tl.arange(0, SP)
    return tl.sum(tl.load(ptr + row * S + offs, mask=offs < S, other=0.0), 0)


@triton.jit
def _row_z(pz_ptr, row, S, SP: tl.constexpr):
    """`1 / z` of a row: z is the softmax normaliser of its top-k survivors (slice sums)."""
    z = _row_sum(pz_ptr, row, S, SP)
    return tl.where(z > 0.0, 1.0 / tl.maximum(z, 1e-30), 0.0)


@triton.jit
def _slice(x_ptr, stride_x, row, sl, span, V, CHUNK: tl.constexpr):
    """`(base, start, end, offs)`: the row's logits, this slice's id range and a chunk's lanes."""
    start = sl * span
    return (
        x_ptr + row.to(tl.int64) * stride_x,
        start,
        tl.minimum(start + span, V),
        tl.arange(0, CHUNK),
    )


@triton.jit
def _row_filters(scalars_ptr, pz_ptr, min_p_ptr, row, S, SP: tl.constexpr):
    """`(t_k, inv_z, p_floor)`: the top-k threshold key, 1 / the normaliser, the min-p floor."""
    inv_z = _row_z(pz_ptr, row, S, SP)
    p_floor = inv_z * tl.load(min_p_ptr + row).to(tl.float32)
    return tl.load(scalars_ptr + row * 2 + _T_K), inv_z, p_floor


@triton.jit
def _stats_kernel(x_ptr, pmax_ptr, pkmin_ptr, stride_x, V, S, span, CHUNK: tl.constexpr):
    """Grid (rows, slices): each slice's largest logit and smallest key."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
    m_part = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    kmin_part = tl.full([CHUNK], 2147483647, dtype=tl.int32)
    for c in range(start, end, CHUNK):
        cols = c + offs
        x = _load_row(base, cols, end)
        m_part = tl.maximum(m_part, x)
        kmin_part = tl.minimum(kmin_part, tl.where(cols < end, order_key(x), 2147483647))
    tl.store(pmax_ptr + row * S + sl, tl.max(m_part, 0))
    tl.store(pkmin_ptr + row * S + sl, tl.min(kmin_part, 0))


@triton.jit
def _top_k_pass_kernel(
    x_ptr, top_k_ptr, pmax_ptr, pkmin_ptr, state_ptr, counts_ptr, stride_x, V, B, S, span, t,
    CHUNK: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """Pass `t` of the top-k search: narrow the row's key range with the previous pass's
    counts, then count this slice's keys >= each new pivot."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    k = tl.load(top_k_ptr + row).to(tl.int64)
    _m, key_min, key_max, samplable = _row_stats(pmax_ptr, pkmin_ptr, row, S, SP)
    if (k > 0) & (k < V) & samplable:
        lo, hi = top_k_search(state_ptr, counts_ptr, row, t, k, key_min, key_max, B, S, SP, NP)
        cur = store_state(state_ptr, t, B, row, sl, lo, hi)
        if hi - lo > 1:
            piv = pivots(lo, hi, NP)
            base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
            part = tl.zeros([CHUNK, NP], dtype=tl.int32)
            for c in range(start, end, CHUNK):
                cols = c + offs
                key = order_key(_load_row(base, cols, end))
                part += ((key[:, None] >= piv[None, :]) & (cols < end)[:, None]).to(tl.int32)
            tl.store(counts_ptr + (cur * S + sl) * NP + tl.arange(0, NP), tl.sum(part, 0))


@triton.jit
def _z_kernel(
    x_ptr, top_k_ptr, pmax_ptr, pkmin_ptr, state_ptr, counts_ptr, scalars_ptr, pz_ptr,
    stride_x, V, B, S, span,
    HAS_TOP_K: tl.constexpr, PASSES: tl.constexpr, CHUNK: tl.constexpr, NP: tl.constexpr,
    SP: tl.constexpr,
):  # fmt: skip
    """The top-k threshold key t_k (slice 0 stores it), then this slice's share of the
    softmax normaliser over the logits whose key >= t_k."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    m, key_min, key_max, samplable = _row_stats(pmax_ptr, pkmin_ptr, row, S, SP)
    t_k = key_min
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row).to(tl.int64)
        if (k > 0) & (k < V) & samplable:
            t_k, _ = top_k_search(
                state_ptr, counts_ptr, row, PASSES, k, key_min, key_max, B, S, SP, NP
            )
    if sl == 0:
        tl.store(scalars_ptr + row * 2 + _T_K, t_k)
    base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
    z_part = tl.zeros([CHUNK], dtype=tl.float32)
    for c in range(start, end, CHUNK):
        cols = c + offs
        x = _load_row(base, cols, end)
        kept = (order_key(x) >= t_k) & (cols < end)
        z_part += tl.where(kept, tl.exp(x - m), 0.0)
    tl.store(pz_ptr + row * S + sl, tl.sum(z_part, 0))


@triton.jit
def _probs(x, m, inv_z):
    return tl.exp(x - m) * inv_z


@triton.jit
def _keys_probs(base, cols, end, m, inv_z):
    """Columns `cols` of the row (`_load_row`): `(cols, their order keys, their
    probabilities)`."""
    x = _load_row(base, cols, end)
    return cols, order_key(x), _probs(x, m, inv_z)


@triton.jit
def _top_p_total_kernel(
    x_ptr, top_p_ptr, min_p_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
    stride_x, V, S, span, CHUNK: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """This slice's float64 mass of the top-k and min-p survivors (top-p rows only)."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    _top_p, m, _key_min, _key_max, searching = _top_p_row(
        top_p_ptr, pmax_ptr, pkmin_ptr, row, S, SP
    )
    if searching:
        t_k, inv_z, p_floor = _row_filters(scalars_ptr, pz_ptr, min_p_ptr, row, S, SP)
        base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
        total = tl.zeros([CHUNK], dtype=tl.float64)
        for c in range(start, end, CHUNK):
            cols = c + offs
            x = _load_row(base, cols, end)
            p = _probs(x, m, inv_z)
            kept = (order_key(x) >= t_k) & (p >= p_floor) & (cols < end)
            total += tl.where(kept, p, 0.0).to(tl.float64)
        tl.store(ptot_ptr + row * S + sl, tl.sum(total, 0))


@triton.jit
def _top_p_pass_kernel(
    x_ptr, top_p_ptr, min_p_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
    state_ptr, masses_ptr, stride_x, V, B, S, span, t,
    CHUNK: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """Pass `t` of the top-p search: narrow the boundary key's range with the previous pass's
    masses, then sum this slice's surviving mass above each new pivot (float64)."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    top_p, m, key_min, key_max, searching = _top_p_row(top_p_ptr, pmax_ptr, pkmin_ptr, row, S, SP)
    if searching:
        bound = top_p.to(tl.float64) * _row_sum(ptot_ptr, row, S, SP)
        lo, hi = top_p_search(state_ptr, masses_ptr, row, t, bound, key_min, key_max, B, S, SP, NP)
        cur = store_state(state_ptr, t, B, row, sl, lo, hi)
        if hi - lo > 1:
            piv = pivots(lo, hi, NP)
            t_k, inv_z, p_floor = _row_filters(scalars_ptr, pz_ptr, min_p_ptr, row, S, SP)
            base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
            part = tl.zeros([CHUNK, NP], dtype=tl.float64)
            for c in range(start, end, CHUNK):
                cols, key, p = _keys_probs(base, c + offs, end, m, inv_z)
                w = tl.where((key >= t_k) & (p >= p_floor) & (cols < end), p, 0.0)
                part += tl.where(key[:, None] > piv[None, :], w.to(tl.float64)[:, None], 0.0)
            tl.store(masses_ptr + (cur * S + sl) * NP + tl.arange(0, NP), tl.sum(part, 0))


@triton.jit
def _ties_kernel(
    x_ptr, top_p_ptr, min_p_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
    state_ptr, masses_ptr, pabove_ptr, pties_ptr, stride_x, V, B, S, span,
    PASSES: tl.constexpr, CHUNK: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """The top-p boundary key k_b (slice 0 stores it), then this slice's surviving mass
    strictly above it and its count of logits tied at it."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    top_p, m, key_min, key_max, searching = _top_p_row(top_p_ptr, pmax_ptr, pkmin_ptr, row, S, SP)
    if searching:
        bound = top_p.to(tl.float64) * _row_sum(ptot_ptr, row, S, SP)
        _, k_b = top_p_search(
            state_ptr, masses_ptr, row, PASSES, bound, key_min, key_max, B, S, SP, NP
        )
        if sl == 0:
            tl.store(scalars_ptr + row * 2 + _K_B, k_b)
        t_k, inv_z, p_floor = _row_filters(scalars_ptr, pz_ptr, min_p_ptr, row, S, SP)
        base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
        above = tl.zeros([CHUNK], dtype=tl.float64)
        ties = tl.zeros([CHUNK], dtype=tl.int32)
        for c in range(start, end, CHUNK):
            cols, key, p = _keys_probs(base, c + offs, end, m, inv_z)
            w = tl.where((key > k_b) & (key >= t_k) & (p >= p_floor) & (cols < end), p, 0.0)
            above += w.to(tl.float64)
            ties += ((key == k_b) & (cols < end)).to(tl.int32)
        tl.store(pabove_ptr + row * S + sl, tl.sum(above, 0))
        tl.store(pties_ptr + row * S + sl, tl.sum(ties, 0))


@triton.jit
def _survivors(
    row, sl, top_p_ptr, min_p_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
    pabove_ptr, pties_ptr, S, HAS_TOP_P: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """What decides a row's survivors: `(m, inv_z, p_floor, lower, k_b, keep_ties,
    limit_ties, ties_before, samplable)`. A logit survives when its key >= `lower` and its
    probability >= `p_floor`, except that with `limit_ties` only the first `keep_ties` logits
    tied at key `k_b` (in id order; `ties_before` of them lie in earlier slices) survive."""
    m, key_min, _key_max, samplable = _row_stats(pmax_ptr, pkmin_ptr, row, S, SP)
    t_k, inv_z, p_floor = _row_filters(scalars_ptr, pz_ptr, min_p_ptr, row, S, SP)
    k_b = key_min - 1
    keep_ties = tl.full([], 2147483647, dtype=tl.int64)
    ties_before = tl.zeros([], dtype=tl.int64)
    limit_ties = k_b > k_b  # False, as a scalar tensor
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        if (top_p < 1.0) & samplable:
            k_b = tl.load(scalars_ptr + row * 2 + _K_B)
            bound = top_p.to(tl.float64) * _row_sum(ptot_ptr, row, S, SP)
            above = _row_sum(pabove_ptr, row, S, SP)
            offs = tl.arange(0, SP)
            ties = tl.load(pties_ptr + row * S + offs, mask=offs < S, other=0).to(tl.int64)
            num_ties = tl.sum(ties, 0)
            ties_before = tl.sum(tl.where(offs < sl, ties, 0), 0)
            p_b = _probs(from_order_key(k_b), m, inv_z).to(tl.float64)
            needed = tl.minimum(tl.ceil((bound - above) / p_b), 2147483647.0)
            keep_ties = tl.maximum(needed.to(tl.int64), 1)
            limit_ties = keep_ties < num_ties
    lower = tl.maximum(t_k, k_b)
    return m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_before, samplable


@triton.jit
def _keep_chunk(x, cols, end, m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_seen):
    """One chunk's survivors as float32 probabilities (0 where filtered), and the ties seen."""
    key = order_key(x)
    p = _probs(x, m, inv_z)
    keep = (key >= lower) & (p >= p_floor) & (cols < end)
    if limit_ties:
        tie = (key == k_b) & (cols < end)
        rank = ties_seen + tl.cumsum(tie.to(tl.int64), 0) - 1
        ties_seen += tl.sum(tie.to(tl.int64), 0)
        keep = keep & (~tie | (rank < keep_ties))
    return tl.where(keep, p, 0.0), ties_seen


@triton.jit
def _keep_kernel(
    x_ptr, top_p_ptr, min_p_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
    pabove_ptr, pties_ptr, pkeep_ptr, probs_ptr, ok_ptr, stride_x, V, S, span,
    HAS_TOP_P: tl.constexpr, WRITE_PROBS: tl.constexpr, CHUNK: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """This slice's float64 surviving mass (and, WRITE_PROBS, its survivors' probabilities);
    slice 0 writes whether the row is samplable."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_seen, samplable = _survivors(
        row, sl, top_p_ptr, min_p_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
        pabove_ptr, pties_ptr, S, HAS_TOP_P, SP,
    )  # fmt: skip
    if sl == 0:
        tl.store(ok_ptr + row, samplable.to(tl.int8))
    base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
    total = tl.zeros([CHUNK], dtype=tl.float64)
    for c in range(start, end, CHUNK):
        cols = c + offs
        x = _load_row(base, cols, end)
        w, ties_seen = _keep_chunk(
            x, cols, end, m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_seen
        )
        total += w.to(tl.float64)
        if WRITE_PROBS:
            tl.store(probs_ptr + row.to(tl.int64) * V + cols, w, mask=cols < end)
    tl.store(pkeep_ptr + row * S + sl, tl.sum(total, 0))


@triton.jit
def _draw_kernel(
    x_ptr, top_p_ptr, min_p_ptr, u_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
    pabove_ptr, pties_ptr, pkeep_ptr, ids_ptr, stride_x, V, S, span,
    HAS_TOP_P: tl.constexpr, CHUNK: tl.constexpr, SP: tl.constexpr,
):  # fmt: skip
    """The inverse-CDF draw: the slice where the float64 cumulative surviving mass (in slice
    order) first reaches `u * total` scans itself in id order and writes the token."""
    row = tl.program_id(0)
    sl = tl.program_id(1)
    m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_seen, samplable = _survivors(
        row, sl, top_p_ptr, min_p_ptr, pmax_ptr, pkmin_ptr, scalars_ptr, pz_ptr, ptot_ptr,
        pabove_ptr, pties_ptr, S, HAS_TOP_P, SP,
    )  # fmt: skip
    if samplable:
        offs_s = tl.arange(0, SP)
        keep = tl.load(pkeep_ptr + row * S + offs_s, mask=offs_s < S, other=0.0)
        cum = tl.cumsum(keep, 0)
        total = tl.sum(tl.where(offs_s == S - 1, cum, 0.0), 0)
        target = tl.load(u_ptr + row).to(tl.float64) * total
        first = tl.min(tl.where((cum >= target) & (offs_s < S), offs_s, S - 1), 0)
        if sl == first:
            cdf = tl.sum(tl.where(offs_s == sl - 1, cum, 0.0), 0)
            base, start, end, offs = _slice(x_ptr, stride_x, row, sl, span, V, CHUNK)
            chosen = tl.full([], -1, dtype=tl.int64)
            last = tl.full([], -1, dtype=tl.int64)
            c = start
            while (c < end) & (chosen < 0):
                cols = c + offs
                x = _load_row(base, cols, end)
                w, ties_seen = _keep_chunk(
                    x, cols, end, m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_seen
                )
                w64 = w.to(tl.float64)
                last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), 0).to(tl.int64))
                chunk = tl.sum(w64, 0)
                if cdf + chunk >= target:
                    hit = ((cdf + tl.cumsum(w64, 0)) >= target) & (w > 0.0) & (cols < end)
                    chosen = tl.min(tl.where(hit, cols, V), 0).to(tl.int64)
                    chosen = tl.where(chosen == V, -1, chosen)
                cdf += chunk
                c += CHUNK
            # Rounding between the slice totals and this scan's sums may leave the target a
            # hair past the slice's end: the slice's last survivor is then the token.
            chosen = tl.where(chosen < 0, last, chosen)
            tl.store(ids_ptr + row, tl.maximum(chosen, 0))
    else:
        if sl == 0:
            tl.store(ids_ptr + row, 0)


def _slices(batch: int, vocab: int, device: torch.device, slices: int | None) -> tuple[int, int]:
    """`(slices, span)`: each row is cut into `slices` ranges of `span` elements (whole
    chunks), enough for about two programs per multiprocessor in all."""
    chunks = triton.cdiv(vocab, _CHUNK)
    if slices is None:
        slices = triton.cdiv(2 * multiprocessor_count(device), batch)
    slices = max(1, min(slices, chunks, _MAX_SLICES))
    span = triton.cdiv(chunks, slices) * _CHUNK
    return triton.cdiv(vocab, span), span


def _launch(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor | None,
    min_p: torch.Tensor | None,
    write_probs: bool,
    has_top_k: bool = True,
    has_top_p: bool = True,
    slices: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    batch, vocab = logits.shape
    device = logits.device
    ids = torch.empty(batch, dtype=torch.int64, device=device)
    ok = torch.empty(batch, dtype=torch.int8, device=device)
    probs = torch.empty((batch, vocab), dtype=torch.float32, device=device) if write_probs else None
    if batch == 0:
        return ids, ok.bool(), probs
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if min_p is None:
        min_p = torch.zeros(batch, dtype=torch.float32, device=device)
    if uniforms is None:
        uniforms = torch.full((batch,), 0.5, dtype=torch.float64, device=device)
    n_slices, span = _slices(batch, vocab, device, slices)
    sp = triton.next_power_of_2(n_slices)
    f32, f64, i64 = torch.float32, torch.float64, torch.int64

    def per_slice(dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((batch, n_slices), dtype=dtype, device=device)

    pmax, pkmin, pz = per_slice(f32), per_slice(torch.int32), per_slice(f32)
    ptot, pabove, pties, pkeep = (
        per_slice(f64),
        per_slice(f64),
        per_slice(torch.int32),
        per_slice(f64),
    )
    scalars = torch.empty((batch, 2), dtype=i64, device=device)
    state = torch.empty((2, batch, 2), dtype=i64, device=device)
    grid = (batch, n_slices)
    common = {"CHUNK": _CHUNK, "num_warps": 4}
    stride, b, s = logits.stride(0), batch, n_slices
    _stats_kernel[grid](logits, pmax, pkmin, stride, vocab, s, span, **common)
    if has_top_k:
        counts = torch.empty((2, batch, n_slices, PIVOTS), dtype=torch.int32, device=device)
        for t in range(PASSES):
            _top_k_pass_kernel[grid](
                logits, top_k, pmax, pkmin, state, counts, stride, vocab, b, s, span, t,
                NP=PIVOTS, SP=sp, **common,
            )  # fmt: skip
    else:
        counts = state  # unused
    _z_kernel[grid](
        logits, top_k, pmax, pkmin, state, counts, scalars, pz, stride, vocab, b, s, span,
        HAS_TOP_K=has_top_k, PASSES=PASSES, NP=PIVOTS, SP=sp, **common,
    )  # fmt: skip
    if has_top_p:
        _top_p_total_kernel[grid](
            logits, top_p, min_p, pmax, pkmin, scalars, pz, ptot, stride, vocab, s, span,
            SP=sp, **common,
        )  # fmt: skip
        masses = torch.empty((2, batch, n_slices, PIVOTS), dtype=f64, device=device)
        for t in range(PASSES):
            _top_p_pass_kernel[grid](
                logits, top_p, min_p, pmax, pkmin, scalars, pz, ptot, state, masses, stride,
                vocab, b, s, span, t, NP=PIVOTS, SP=sp, **common,
            )  # fmt: skip
        _ties_kernel[grid](
            logits, top_p, min_p, pmax, pkmin, scalars, pz, ptot, state, masses, pabove, pties,
            stride, vocab, b, s, span, PASSES=PASSES, NP=PIVOTS, SP=sp, **common,
        )  # fmt: skip
    tail = (pmax, pkmin, scalars, pz, ptot, pabove, pties, pkeep)
    _keep_kernel[grid](
        logits, top_p, min_p, *tail, probs if probs is not None else pkeep, ok, stride, vocab,
        s, span, HAS_TOP_P=has_top_p, WRITE_PROBS=write_probs, SP=sp, **common,
    )  # fmt: skip
    if not write_probs:
        _draw_kernel[grid](
            logits, top_p, min_p, uniforms, *tail, ids, stride, vocab, s, span,
            HAS_TOP_P=has_top_p, SP=sp, **common,
        )  # fmt: skip
    return ids, ok.bool(), probs


def top_k_top_p_sample(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
    min_p: torch.Tensor | None = None, *, has_top_k: bool = True, has_top_p: bool = True,
    slices: int | None = None, temperature: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Draw one token per row of processed logits `[B, V]`; see `reference.top_k_top_p_sample`.

    `top_k` `[B]` int (<= 0 or >= V: off), `top_p` `[B]` float (>= 1: off), `uniforms` `[B]`
    float64 in (0, 1), `min_p` `[B]` float (<= 0 or None: off). Returns `(token_ids [B]
    int64, samplable [B] bool)`; a row without a finite logit gets token 0, samplable False.
    `has_top_k=False` / `has_top_p=False` promise that no row has that filter on (the caller
    knows from the host-side parameters) and skip its search launches. `slices` overrides how
    many programs share a row (tests).

    `active` (`[B]` bool) or `temperature` (`[B]`, the logits then untempered) given: the
    one-launch kernel of `triton_full_row_draw` instead (one program per row; rows `active`
    leaves out give token 0, samplable False), for the few rows the sampler's candidate draw
    re-routes.
    """
    if active is not None or temperature is not None:
        from metrale.kernels.triton_full_row_draw import full_row_sample

        if active is None:
            active = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        return full_row_sample(logits, top_k, top_p, uniforms, min_p, temperature, active)
    ids, ok, _ = _launch(logits, top_k, top_p, uniforms, min_p, False, has_top_k, has_top_p, slices)
    return ids, ok


def top_k_top_p_filter(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    min_p: torch.Tensor | None = None, *, slices: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The probabilities the draw uses, `[B, V]` float32 (0 where filtered; unnormalised),
    and `samplable`; see `reference.top_k_top_p_filter`. Costs one extra write of `[B, V]`."""
    _, ok, probs = _launch(logits, top_k, top_p, None, min_p, True, slices=slices)
    assert probs is not None
    return probs, ok
