"""Exact threshold search over the order-preserving integer keys of float32 values, split
over many programs: the machinery of the sort-free top-k / top-p draw (`triton_top_k_top_p`).

Owner: kernels. A search pass runs on every slice of a row: each program narrows the row's
key range `[lo, hi)` with the previous pass's per-slice partials (counts of keys >= each
pivot for top-k, float64 masses above each pivot for top-p), then the caller computes its own
slice's partials for the new pivots. `PASSES` passes reach one key from any int32 range.

Invariants:
- `order_key` is order-preserving (a < b <=> order_key(a) < order_key(b)); -0.0 and +0.0 share
  a key.
- Every program of a row derives the same `(lo, hi)`: the partials are summed in slice order.
- Pass `t` stores its state in slot `t % 2` and reads slot `(t - 1) % 2` (slice 0 stores), so
  a launch never overwrites what it reads.
- Top-k: `count(key >= lo) >= k > count(key >= hi)` throughout, the answer is `lo`. Top-p:
  `mass(key > lo) >= bound > mass(key > hi)` throughout, the answer is `hi`. The starting
  ranges (`top_k_search` / `top_p_search`) live here only.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Pivots per search pass: each pass narrows the threshold's key range at least 17-fold.
PIVOTS = 16
#: Search passes per threshold: 8 passes of 16 pivots take any range of 2**32 keys to one key.
PASSES = 8


@triton.jit
def order_key(x):
    """Order-preserving int32 key of float32 `x` (no NaN)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are the same logit
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def from_order_key(key):
    """The float32 whose `order_key` is `key` (a scalar)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pivots(lo, hi, NP: tl.constexpr):
    """NP int32 pivots spread strictly inside (lo, hi) when hi - lo >= 2 (at least one);
    `lo`, `hi` are int64 scalars within int32 range (the product needs 64 bits)."""
    j = tl.arange(0, NP).to(tl.int64)
    return (lo + ((hi - lo) * (j + 1)) // (NP + 1)).to(tl.int32)


@triton.jit
def search_state(
    state_ptr, part_ptr, row, t, lo0, hi0, target, B, S,
    SP: tl.constexpr, NP: tl.constexpr, MASS: tl.constexpr,
):  # fmt: skip
    """`(lo, hi)` of a row's threshold search after `t` passes, from the state the previous
    pass stored and that pass's per-slice partials (summed here in slice order).

    Counting (MASS False, top-k): the answer is the largest key with count(key >= it) >=
    `target` (= k); `count(key >= lo) >= k > count(key >= hi)` holds throughout. Mass (top-p):
    the smallest key with mass(key > it) < `target` (= the bound); `mass(key > lo) >= bound >
    mass(key > hi)` holds throughout. Pass `t` stores into slot `t % 2` and reads slot
    `(t - 1) % 2`, so a pass never overwrites what it reads."""
    lo = lo0
    hi = hi0
    if t > 0:
        prev = ((t - 1) % 2) * B + row
        lo = tl.load(state_ptr + prev * 2)
        hi = tl.load(state_ptr + prev * 2 + 1)
        if hi - lo > 1:
            piv = pivots(lo, hi, NP)
            offs_s = tl.arange(0, SP)
            offs_j = tl.arange(0, NP)
            part = tl.load(
                part_ptr + (prev * S + offs_s[:, None]) * NP + offs_j[None, :],
                mask=(offs_s < S)[:, None],
                other=0,
            )
            total = tl.sum(part, 0)
            if MASS:
                below = total < target
                hi = tl.min(tl.where(below, piv, hi), 0)
                lo = tl.max(tl.where(below, lo, piv), 0)
            else:
                enough = total.to(tl.int64) >= target
                lo = tl.max(tl.where(enough, piv, lo), 0)
                hi = tl.min(tl.where(enough, hi, piv), 0)
    return lo, hi


@triton.jit
def store_state(state_ptr, t, B, row, sl, lo, hi):
    """Slice 0 stores pass `t`'s search state in slot `t % 2`; returns the slot's row index."""
    cur = (t % 2) * B + row
    if sl == 0:
        tl.store(state_ptr + cur * 2, lo)
        tl.store(state_ptr + cur * 2 + 1, hi)
    return cur


@triton.jit
def top_k_search(
    state_ptr, counts_ptr, row, t, k, key_min, key_max, B, S, SP: tl.constexpr, NP: tl.constexpr
):
    """`(lo, hi)` of a row's top-k search after `t` passes; `lo` is the k-th largest key once
    the search has converged."""
    return search_state(state_ptr, counts_ptr, row, t, key_min, key_max + 1, k, B, S, SP, NP, False)


@triton.jit
def top_p_search(
    state_ptr, masses_ptr, row, t, bound, key_min, key_max, B, S, SP: tl.constexpr, NP: tl.constexpr
):
    """`(lo, hi)` of a row's top-p search after `t` passes; `hi` is the boundary key once the
    search has converged."""
    return search_state(
        state_ptr, masses_ptr, row, t, key_min - 1, key_max, bound, B, S, SP, NP, True
    )
