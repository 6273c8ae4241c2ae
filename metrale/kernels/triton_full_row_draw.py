"""The full-row draw of a few rows in one launch: the sampler's re-route for rows its candidate
draw cannot hold (`metrale.sampling.candidates`), normally none.

Owner: kernels. `reference.top_k_top_p_sample` (with `temperature=` and `active=`) defines
the function; `triton_top_k_top_p.top_k_top_p_sample` calls this kernel when given `active`
or `temperature`.
`tests/gpu/test_sampler_kernels.py` checks it against the reference.

Why a second kernel: the split-row kernel of `triton_top_k_top_p` is a chain of up to 21
launches whatever the rows; gated by `active` to rows that are almost never there, the chain
would still cost every sampled step its launches. Here one launch of one program per row does
it all: a row that `active` leaves out stores token 0, samplable False and stops, so a batch
without re-routed rows pays one near-empty launch.

Invariants:
- The function is `triton_top_k_top_p`'s, with the same helpers (order keys, `_keep_chunk`,
  probabilities `exp(x - m) * inv_z`): top-k threshold = the largest key with
  count(key >= it) >= k; top-p boundary = the smallest key with the surviving float64 mass
  above it < top_p * total, its ties kept in id order as the mass allows; the inverse-CDF
  draw in id order on float64 cumulative sums.
- Each threshold is found by 16-way searches over the int32 keys (at most 8 passes over the
  row each), in the program's own registers: no state in memory, no host synchronisation.
- With `temperature`, logits are divided as loaded (IEEE division), NaN reads as -inf and
  +inf as the float32 max, as the sampler tempers and sanitizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_key_search import PIVOTS, from_order_key, order_key, pivots
from metrale.kernels.triton_top_k_top_p import _keep_chunk, _probs

#: Elements per chunk of the row loops.
_CHUNK = 256


@triton.jit
def _load_row(base, cols, V, temp, HAS_TEMP: tl.constexpr):
    """A chunk of a row as float32, NaN read as -inf; with HAS_TEMP divided by the row's
    temperature first (IEEE division, as torch divides) and +inf read as the float32 max
    (the sampler's `_temper` then `_sanitize`)."""
    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    if HAS_TEMP:
        x = tl.math.div_rn(x, temp)
        x = tl.where(x != x, float("-inf"), x)
        return tl.minimum(x, 3.4028234663852886e38)
    return tl.where(x != x, float("-inf"), x)


@triton.jit
def _row_temp(temp_ptr, row, HAS_TEMP: tl.constexpr):
    """The row's temperature as float32 (1.0 without HAS_TEMP, unused then)."""
    temp = tl.full([], 1.0, dtype=tl.float32)
    if HAS_TEMP:
        temp = tl.load(temp_ptr + row).to(tl.float32)
    return temp


@triton.jit
def _full_row_kernel(
    x_ptr, temp_ptr, active_ptr, top_k_ptr, top_p_ptr, min_p_ptr, u_ptr, ids_ptr, ok_ptr,
    stride_x, V,
    HAS_TEMP: tl.constexpr, HAS_MIN_P: tl.constexpr, CHUNK: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    tl.store(ids_ptr + row, 0)
    tl.store(ok_ptr + row, 0)
    if tl.load(active_ptr + row) != 0:
        base = x_ptr + row.to(tl.int64) * stride_x
        temp = _row_temp(temp_ptr, row, HAS_TEMP)
        offs = tl.arange(0, CHUNK)
        # The row's largest logit and key range.
        m_part = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
        kmin_part = tl.full([CHUNK], 2147483647, dtype=tl.int32)
        for c in range(0, V, CHUNK):
            cols = c + offs
            x = _load_row(base, cols, V, temp, HAS_TEMP)
            m_part = tl.maximum(m_part, x)
            kmin_part = tl.minimum(kmin_part, tl.where(cols < V, order_key(x), 2147483647))
        m = tl.max(m_part, 0)
        if m > float("-inf"):
            key_min = tl.min(kmin_part, 0).to(tl.int64)
            key_max = order_key(m).to(tl.int64)
            # Top-k: the largest key with count(key >= it) >= k.
            k = tl.load(top_k_ptr + row).to(tl.int64)
            t_k = key_min
            if (k > 0) & (k < V):
                lo = key_min
                hi = key_max + 1
                while hi - lo > 1:
                    piv = pivots(lo, hi, NP)
                    part = tl.zeros([CHUNK, NP], dtype=tl.int32)
                    for c in range(0, V, CHUNK):
                        cols = c + offs
                        key = order_key(_load_row(base, cols, V, temp, HAS_TEMP))
                        hit = (key[:, None] >= piv[None, :]) & (cols < V)[:, None]
                        part += hit.to(tl.int32)
                    enough = tl.sum(part, 0).to(tl.int64) >= k
                    new_lo = tl.max(tl.where(enough, piv, lo), 0)
                    hi = tl.min(tl.where(enough, hi, piv), 0)
                    lo = new_lo
                t_k = lo
            # The softmax normaliser over the top-k survivors; the min-p floor.
            z_part = tl.zeros([CHUNK], dtype=tl.float32)
            for c in range(0, V, CHUNK):
                cols = c + offs
                x = _load_row(base, cols, V, temp, HAS_TEMP)
                kept = (order_key(x) >= t_k) & (cols < V)
                z_part += tl.where(kept, tl.exp(x - m), 0.0)
            inv_z = 1.0 / tl.sum(z_part, 0)
            p_floor = tl.zeros([], dtype=tl.float32)
            if HAS_MIN_P:
                p_floor = inv_z * tl.load(min_p_ptr + row).to(tl.float32)
            # Top-p: the smallest key whose surviving mass above is < bound, and its ties.
            top_p = tl.load(top_p_ptr + row).to(tl.float32)
            k_b = key_min - 1
            keep_ties = tl.full([], 2147483647, dtype=tl.int64)
            limit_ties = k_b > k_b  # False, as a scalar tensor
            if top_p < 1.0:
                total = tl.zeros([CHUNK], dtype=tl.float64)
                for c in range(0, V, CHUNK):
                    cols = c + offs
                    x = _load_row(base, cols, V, temp, HAS_TEMP)
                    p = _probs(x, m, inv_z)
                    kept = (order_key(x) >= t_k) & (p >= p_floor) & (cols < V)
                    total += tl.where(kept, p, 0.0).to(tl.float64)
                bound = top_p.to(tl.float64) * tl.sum(total, 0)
                lo = key_min - 1
                hi = key_max
                while hi - lo > 1:
                    piv = pivots(lo, hi, NP)
                    mass = tl.zeros([CHUNK, NP], dtype=tl.float64)
                    for c in range(0, V, CHUNK):
                        cols = c + offs
                        x = _load_row(base, cols, V, temp, HAS_TEMP)
                        key = order_key(x)
                        p = _probs(x, m, inv_z)
                        w = tl.where((key >= t_k) & (p >= p_floor) & (cols < V), p, 0.0)
                        above = key[:, None] > piv[None, :]
                        mass += tl.where(above, w.to(tl.float64)[:, None], 0.0)
                    below = tl.sum(mass, 0) < bound
                    new_hi = tl.min(tl.where(below, piv, hi), 0)
                    lo = tl.max(tl.where(below, lo, piv), 0)
                    hi = new_hi
                k_b = hi
                above_b = tl.zeros([CHUNK], dtype=tl.float64)
                ties = tl.zeros([CHUNK], dtype=tl.int32)
                for c in range(0, V, CHUNK):
                    cols = c + offs
                    x = _load_row(base, cols, V, temp, HAS_TEMP)
                    key = order_key(x)
                    p = _probs(x, m, inv_z)
                    w = tl.where((key > k_b) & (key >= t_k) & (p >= p_floor) & (cols < V), p, 0.0)
                    above_b += w.to(tl.float64)
                    ties += ((key == k_b) & (cols < V)).to(tl.int32)
                p_b = _probs(from_order_key(k_b), m, inv_z).to(tl.float64)
                needed = tl.minimum(tl.ceil((bound - tl.sum(above_b, 0)) / p_b), 2147483647.0)
                keep_ties = tl.maximum(needed.to(tl.int64), 1)
                limit_ties = keep_ties < tl.sum(ties, 0).to(tl.int64)
            lower = tl.maximum(t_k, k_b)
            # The surviving mass, then the draw in id order.
            ties_seen = tl.zeros([], dtype=tl.int64)
            keep_total = tl.zeros([CHUNK], dtype=tl.float64)
            for c in range(0, V, CHUNK):
                cols = c + offs
                x = _load_row(base, cols, V, temp, HAS_TEMP)
                w, ties_seen = _keep_chunk(
                    x, cols, V, m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_seen
                )
                keep_total += w.to(tl.float64)
            target = tl.load(u_ptr + row).to(tl.float64) * tl.sum(keep_total, 0)
            ties_seen = tl.zeros([], dtype=tl.int64)
            cdf = tl.zeros([], dtype=tl.float64)
            chosen = tl.full([], -1, dtype=tl.int64)
            last = tl.full([], -1, dtype=tl.int64)
            c = tl.zeros([], dtype=tl.int32)
            while (c < V) & (chosen < 0):
                cols = c + offs
                x = _load_row(base, cols, V, temp, HAS_TEMP)
                w, ties_seen = _keep_chunk(
                    x, cols, V, m, inv_z, p_floor, lower, k_b, keep_ties, limit_ties, ties_seen
                )
                w64 = w.to(tl.float64)
                last = tl.maximum(last, tl.max(tl.where(w > 0.0, cols, -1), 0).to(tl.int64))
                chunk = tl.sum(w64, 0)
                if cdf + chunk >= target:
                    hit = ((cdf + tl.cumsum(w64, 0)) >= target) & (w > 0.0) & (cols < V)
                    chosen = tl.min(tl.where(hit, cols, V), 0).to(tl.int64)
                    chosen = tl.where(chosen == V, -1, chosen)
                cdf += chunk
                c += CHUNK
            # Rounding between the two passes' sums may leave the target a hair past the
            # last survivor: that survivor is then the token.
            chosen = tl.where(chosen < 0, last, chosen)
            tl.store(ids_ptr + row, tl.maximum(chosen, 0))
            tl.store(ok_ptr + row, 1)


def full_row_sample(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    min_p: torch.Tensor | None,
    temperature: torch.Tensor | None,
    active: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.top_k_top_p_sample(..., temperature=, active=)` in one launch, one program
    per row; rows `active` leaves out give token 0, samplable False and cost one load."""
    batch, vocab = logits.shape
    device = logits.device
    ids = torch.empty(batch, dtype=torch.int64, device=device)
    ok = torch.empty(batch, dtype=torch.int8, device=device)
    if batch == 0:
        return ids, ok.bool()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temp = ids if temperature is None else temperature.contiguous()
    floor = ids if min_p is None else min_p.contiguous()
    _full_row_kernel[(batch,)](
        logits, temp, active.to(torch.int8).contiguous(), top_k.contiguous(),
        top_p.contiguous(), floor, uniforms.contiguous(), ids, ok, logits.stride(0), vocab,
        HAS_TEMP=temperature is not None, HAS_MIN_P=min_p is not None, CHUNK=_CHUNK,
        NP=PIVOTS, num_warps=4,
    )  # fmt: skip
    return ids, ok.bool()
