"""Triton kernels for the sampler's hot path: greedy argmax on the device, and top-k / min-p /
top-p filtering with the inverse-CDF draw, without sorting the vocabulary.

Owner: kernels. `reference.argmax` and `reference.top_k_top_p_sample` define the functions;
`tests/gpu/test_kernels.py` checks the kernels against them. The sampler (metrale/sampling)
decides when to call them.

Invariants:
- No host synchronisation; one program per row; every output element is written.
- `argmax`: NaN reads as -inf; ties go to the lowest index (torch.argmax); a row of -inf gives
  index 0 and value -inf.
- `greedy_logprobs`: the argmax (as `argmax`, +inf read as the float32 max) with its raw
  logprob from an online logsumexp, packed as the sampler reads it back; equal to the
  reference up to float32 summation order in the logsumexp.
- `top_k_top_p_sample` takes already processed float logits (penalties, bias, temperature,
  NaN -> -inf) and applies, per row and in this order: top-k (every logit >= the k-th largest
  stays), softmax, min-p (probabilities >= min_p * max), top-p (a token stays while the mass
  ranked above it, ties ranked by id, is < top_p * the remaining mass; masses are summed in
  float64: over a 152k vocabulary float32 sums in two different orders disagree about which
  token crosses the bound), then draws the first
  token in id order whose float64 cumulative probability reaches `u * total`. Thresholds are
  found exactly by a 16-way search over the order-preserving integer keys of the float32
  logits (at most 8 passes over the row per threshold), not by sorting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Pivots per search pass: each pass narrows the threshold's key range about 17-fold.
_PIVOTS = 16


@triton.jit
def _argmax_kernel(x_ptr, ids_ptr, values_ptr, stride_x, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_id = tl.full([], 0, dtype=tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        chunk_max = tl.max(x, 0)
        chunk_id = tl.min(tl.where(x == chunk_max, cols, V), 0).to(tl.int64)
        better = chunk_max > best
        best_id = tl.where(better, chunk_id, best_id)
        best = tl.where(better, chunk_max, best)
    tl.store(ids_ptr + row, best_id)
    tl.store(values_ptr + row, best)


def argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `[B, V]`: `(index of the largest logit [B] int64, its value [B] float32)`."""
    batch, vocab = logits.shape
    ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    values = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return ids, values
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = min(4096, triton.next_power_of_2(vocab))
    _argmax_kernel[(batch,)](
        logits,
        ids,
        values,
        logits.stride(0),
        vocab,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )
    return ids, values


@triton.jit
def _greedy_logprobs_kernel(x_ptr, ids_ptr, packed_ptr, stride_x, V, BLOCK: tl.constexpr):
    """One pass over a row: running max, its first index, and the sum of exp(x - max)
    rescaled as the max grows (online logsumexp)."""
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_id = tl.full([], 0, dtype=tl.int64)
    total = tl.full([], 0.0, dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        x = tl.minimum(x, 3.4028234663852886e38)  # +inf reads as the float32 max
        chunk_max = tl.max(x, 0)
        chunk_id = tl.min(tl.where(x == chunk_max, cols, V), 0).to(tl.int64)
        better = chunk_max > best
        new_best = tl.maximum(best, chunk_max)
        if new_best > float("-inf"):
            total = total * tl.exp(best - new_best) + tl.sum(tl.exp(x - new_best), 0)
        best_id = tl.where(better, chunk_id, best_id)
        best = new_best
    finite = best > float("-inf")
    lse = best + tl.log(total)
    logprob = tl.where(finite, best - lse, float("-inf"))
    tl.store(ids_ptr + row, best_id)
    out = packed_ptr + row.to(tl.int64) * 4
    tl.store(out, best_id.to(tl.float64))
    tl.store(out + 1, logprob.to(tl.float64))
    tl.store(out + 2, tl.full([], 1.0, dtype=tl.float64))
    tl.store(out + 3, tl.where(finite, 1.0, 0.0).to(tl.float64))


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.greedy_logprobs` in one launch: one program per row, one pass over it."""
    batch, vocab = logits.shape
    ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    packed = torch.empty((batch, 4), dtype=torch.float64, device=logits.device)
    if batch == 0:
        return ids, packed
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = min(4096, triton.next_power_of_2(vocab))
    _greedy_logprobs_kernel[(batch,)](
        logits, ids, packed, logits.stride(0), vocab, BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return ids, packed


# -------------------------------------------------------------------------------------------
# top-k / min-p / top-p sampling by threshold search
# -------------------------------------------------------------------------------------------


@triton.jit
def _key(x):
    """Order-preserving int32 key of float32 `x` (no NaN): a < b <=> key(a) < key(b)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 are the same logit
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _unkey(key):
    """The float32 whose `_key` is `key` (a scalar)."""
    bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_row(base, cols, V):
    x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    return tl.where(x != x, float("-inf"), x)


@triton.jit
def _pivots(lo, hi, NP: tl.constexpr):
    """NP int32 pivots spread strictly inside (lo, hi) when hi - lo >= 2 (at least one);
    `lo`, `hi` are int64 scalars within int32 range (the product needs 64 bits)."""
    j = tl.arange(0, NP).to(tl.int64)
    return (lo + ((hi - lo) * (j + 1)) // (NP + 1)).to(tl.int32)


@triton.jit
def _top_k_top_p_kernel(
    x_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    u_ptr,
    ids_ptr,
    ok_ptr,
    probs_ptr,
    stride_x,
    V,
    BLOCK: tl.constexpr,
    NP: tl.constexpr,
    WRITE_PROBS: tl.constexpr,
):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    offs = tl.arange(0, BLOCK)

    # Every pass accumulates per-element partials and reduces across the block once at its
    # end (a cross-warp reduction per chunk would cost more than the chunk's loads).
    # Pass 1: the row's largest logit and the key range.
    m_part = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    kmin_part = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = _load_row(base, cols, V)
        m_part = tl.maximum(m_part, x)
        kmin_part = tl.minimum(kmin_part, tl.where(cols < V, _key(x), 2147483647))
    m = tl.max(m_part, 0)
    key_min = tl.min(kmin_part, 0).to(tl.int64)
    samplable = m > float("-inf")
    key_max = _key(m).to(tl.int64)
    m = tl.where(samplable, m, 0.0)  # a row without a finite logit: every p below is 0

    # Top-k: t = the largest key with count(key >= t) >= k (the k-th largest logit's key).
    k = tl.load(top_k_ptr + row).to(tl.int64)
    t_k = key_min
    if (k > 0) & (k < V) & samplable:
        lo = key_min  # count(key >= lo) = V >= k
        hi = key_max + 1  # count(key >= hi) = 0 < k
        while hi - lo > 1:
            piv = _pivots(lo, hi, NP)
            cnt_part = tl.zeros([BLOCK, NP], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + offs
                key = _key(_load_row(base, cols, V))
                hit = (key[:, None] >= piv[None, :]) & (cols < V)[:, None]
                cnt_part += hit.to(tl.int32)
            enough = tl.sum(cnt_part, 0).to(tl.int64) >= k
            lo = tl.max(tl.where(enough, piv, lo), 0)
            hi = tl.min(tl.where(enough, hi, piv), 0)
        t_k = lo

    # Softmax normaliser over the top-k survivors.
    z_part = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = _load_row(base, cols, V)
        kept = (_key(x) >= t_k) & (cols < V)
        z_part += tl.where(kept, tl.exp(x - m), 0.0)
    z = tl.sum(z_part, 0)
    inv_z = tl.where(z > 0.0, 1.0 / tl.maximum(z, 1e-30), 0.0)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    p_floor = inv_z * min_p  # min-p: a probability below min_p * max (max = 1/z) is dropped
    top_p = tl.load(top_p_ptr + row).to(tl.float32)

    # Top-p: k_b = the smallest key with mass(key > k_b) < top_p * total; ties at k_b are
    # kept in id order while the mass ranked above them stays below the bound.
    k_b = key_min - 1
    keep_ties = tl.full([], 2147483647, dtype=tl.int64)
    limit_ties = k_b > k_b  # False (a scalar tensor, reassigned below)
    if (top_p < 1.0) & samplable:
        total_part = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = _load_row(base, cols, V)
            p = tl.exp(x - m) * inv_z
            kept = (_key(x) >= t_k) & (p >= p_floor) & (cols < V)
            total_part += tl.where(kept, p, 0.0).to(tl.float64)
        bound = top_p.to(tl.float64) * tl.sum(total_part, 0)
        lo = key_min - 1  # mass(key > lo) = total >= bound
        hi = key_max  # mass(key > hi) = 0 < bound
        while hi - lo > 1:
            piv = _pivots(lo, hi, NP)
            mass_part = tl.zeros([BLOCK, NP], dtype=tl.float64)
            for start in range(0, V, BLOCK):
                cols = start + offs
                x = _load_row(base, cols, V)
                key = _key(x)
                p = tl.exp(x - m) * inv_z
                w = tl.where((key >= t_k) & (p >= p_floor) & (cols < V), p, 0.0)
                mass_part += tl.where(key[:, None] > piv[None, :], w.to(tl.float64)[:, None], 0.0)
            below = tl.sum(mass_part, 0) < bound
            hi = tl.min(tl.where(below, piv, hi), 0)
            lo = tl.max(tl.where(below, lo, piv), 0)
        k_b = hi
        above_part = tl.zeros([BLOCK], dtype=tl.float64)
        ties_part = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            x = _load_row(base, cols, V)
            key = _key(x)
            p = tl.exp(x - m) * inv_z
            w = tl.where((key > k_b) & (key >= t_k) & (p >= p_floor) & (cols < V), p, 0.0)
            above_part += w.to(tl.float64)
            ties_part += ((key == k_b) & (cols < V)).to(tl.int32)
        above = tl.sum(above_part, 0)
        num_ties = tl.sum(ties_part, 0).to(tl.int64)
        p_b = (tl.exp(_unkey(k_b) - m) * inv_z).to(tl.float64)
        ties = tl.minimum(tl.ceil((bound - above) / p_b), 2147483647.0)
        keep_ties = tl.maximum(ties.to(tl.int64), 1)
        # Only a boundary tie that top-p cuts through needs id-order ranks (a scan).
        limit_ties = keep_ties < num_ties

    # Total surviving mass (float64), then the inverse-CDF draw in token-id order.
    lower = tl.maximum(t_k, k_b)
    total_part = tl.zeros([BLOCK], dtype=tl.float64)
    ties_seen = tl.zeros([], dtype=tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = _load_row(base, cols, V)
        key = _key(x)
        p = tl.exp(x - m) * inv_z
        keep = (key >= lower) & (p >= p_floor) & (cols < V)
        if limit_ties:
            tie = (key == k_b) & (cols < V)
            rank = ties_seen + tl.cumsum(tie.to(tl.int64), 0) - 1
            ties_seen += tl.sum(tie.to(tl.int64), 0)
            keep = keep & (~tie | (rank < keep_ties))
        total_part += tl.where(keep, p, 0.0).to(tl.float64)
        if WRITE_PROBS:
            tl.store(probs_ptr + row.to(tl.int64) * V + cols, tl.where(keep, p, 0.0), mask=cols < V)
    target = tl.load(u_ptr + row).to(tl.float64) * tl.sum(total_part, 0)
    cdf = tl.zeros([], dtype=tl.float64)
    ties_seen = tl.zeros([], dtype=tl.int64)
    chosen = tl.full([], V, dtype=tl.int64)
    start = 0
    while (start < V) & (chosen == V):
        cols = start + offs
        x = _load_row(base, cols, V)
        key = _key(x)
        p = tl.exp(x - m) * inv_z
        keep = (key >= lower) & (p >= p_floor) & (cols < V)
        if limit_ties:
            tie = (key == k_b) & (cols < V)
            rank = ties_seen + tl.cumsum(tie.to(tl.int64), 0) - 1
            ties_seen += tl.sum(tie.to(tl.int64), 0)
            keep = keep & (~tie | (rank < keep_ties))
        w = tl.where(keep, p, 0.0).to(tl.float64)
        chunk = tl.sum(w, 0)
        if cdf + chunk >= target:  # the chosen token is in this chunk: scan it
            hit = ((cdf + tl.cumsum(w, 0)) >= target) & (cols < V)
            chosen = tl.min(tl.where(hit, cols.to(tl.int64), V), 0)
        cdf += chunk
        start += BLOCK
    chosen = tl.minimum(chosen, V - 1)
    chosen = tl.where(samplable, chosen, 0)
    tl.store(ids_ptr + row, chosen)
    tl.store(ok_ptr + row, samplable.to(tl.int8))


def _launch(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor | None,
    min_p: torch.Tensor | None,
    write_probs: bool,
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
    block = min(1024, triton.next_power_of_2(vocab))
    _top_k_top_p_kernel[(batch,)](
        logits,
        top_k,
        top_p,
        min_p,
        uniforms,
        ids,
        ok,
        probs if probs is not None else ids,
        logits.stride(0),
        vocab,
        BLOCK=block,
        NP=_PIVOTS,
        WRITE_PROBS=write_probs,
        num_warps=8,
    )
    return ids, ok.bool(), probs


def top_k_top_p_sample(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of processed logits `[B, V]`; see `reference.top_k_top_p_sample`.

    `top_k` `[B]` int (<= 0 or >= V: off), `top_p` `[B]` float (>= 1: off), `uniforms` `[B]`
    float64 in (0, 1), `min_p` `[B]` float (<= 0 or None: off). Returns `(token_ids [B]
    int64, samplable [B] bool)`; a row without a finite logit gets token 0, samplable False.
    """
    ids, ok, _ = _launch(logits, top_k, top_p, uniforms, min_p, write_probs=False)
    return ids, ok


def top_k_top_p_filter(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities the draw uses, `[B, V]` float32 (0 where filtered; unnormalised),
    and `samplable`; see `reference.top_k_top_p_filter`. Costs one extra write of `[B, V]`."""
    _, ok, probs = _launch(logits, top_k, top_p, None, min_p, write_probs=True)
    assert probs is not None
    return probs, ok
