"""The sampler's draw on each row's top candidates in one launch (the candidate draw's stages
after `torch.topk`).

Owner: kernels. `reference.candidate_sample` defines the function; `tests/gpu/
test_sampler_kernels.py` checks this kernel against it. The sampler
(`metrale.sampling.candidates`) decides when to call it.

Invariants:
- One program per row holds its `W` candidates (a power of two, at most 2048) in registers:
  tempering (IEEE division, then NaN -> -inf, +inf -> float32 max), the top-k threshold (the
  k-th candidate), softmax, min-p, top-p and the draw, with no memory between stages and no
  host synchronisation; every output element is written.
- Orders are sorts of packed int64 keys: top-p ranks by (probability descending, token id
  ascending) through `probability bits << 32 | (2**32 - 1 - id)`, the draw runs in token-id
  order through `id << 32 | probability bits` (a non-negative float32's bits order as the
  float). Token ids are < 2**31.
- Masses and the cumulative draw are float64, as in the torch path; the float32 softmax
  normaliser and the float64 sums are reduced in another order than torch's (equal results
  up to rounding; a seeded row draws the same token unless its uniform falls within
  rounding of a boundary).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOW = tl.constexpr(4294967295)  # 2**32 - 1


@triton.jit
def _candidate_kernel(
    values_ptr, ids_ptr, table_ptr, out_ids_ptr, ok_ptr, rerouted_ptr,
    stride_v, stride_i, B, V,
    W: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, W)
    low = tl.full([W], _LOW, dtype=tl.int64)
    values = tl.load(values_ptr + row.to(tl.int64) * stride_v + offs).to(tl.float32)
    ids = tl.load(ids_ptr + row.to(tl.int64) * stride_i + offs).to(tl.int64)
    temp = tl.load(table_ptr + row).to(tl.float32)
    k = tl.load(table_ptr + B + row).to(tl.int64)
    top_p = tl.load(table_ptr + 2 * B + row).to(tl.float32)
    min_p = tl.load(table_ptr + 3 * B + row).to(tl.float32)
    u = tl.load(table_ptr + 4 * B + row).to(tl.float64)

    has_nan = tl.max((values != values).to(tl.int32), 0) > 0
    x = tl.math.div_rn(values, temp)
    x = tl.where(x != x, float("-inf"), x)
    x = tl.minimum(x, 3.4028234663852886e38)
    k = tl.minimum(tl.maximum(k, 1), W)
    threshold = tl.max(tl.where(offs == k - 1, x, float("-inf")), 0)
    last = tl.max(tl.where(offs == W - 1, x, float("-inf")), 0)
    spill = (last >= threshold) & (threshold > float("-inf")) & (V > W)
    rerouted = has_nan | spill

    m = tl.max(x, 0)
    e = tl.where(x >= threshold, tl.exp(x - m), 0.0)
    probs = tl.math.div_rn(e, tl.zeros_like(e) + tl.sum(e, 0))
    samplable = m > float("-inf")
    probs = tl.where(samplable, probs, 0.0)
    if HAS_MIN_P:
        floor = tl.max(probs, 0) * min_p
        probs = tl.where(probs < floor, 0.0, probs)
    if HAS_TOP_P:
        bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
        ranked = tl.sort((bits << 32) | (low - ids), descending=True)
        ranked_ids = low - (ranked & low)
        ranked_p = (ranked >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        wide = ranked_p.to(tl.float64)
        mass_above = tl.cumsum(wide, 0) - wide
        bound = tl.sum(wide, 0) * top_p.to(tl.float64)
        keep = (mass_above < bound) | ((tl.zeros_like(wide) + top_p.to(tl.float64)) >= 1.0)
        ranked_p = tl.where(keep, ranked_p, 0.0)
        kept_bits = ranked_p.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.sort((ranked_ids << 32) | kept_bits)
    else:
        bits = probs.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.sort((ids << 32) | bits)
    ordered_ids = ordered >> 32
    ordered_p = (ordered & low).to(tl.int32).to(tl.float32, bitcast=True)
    cdf = tl.cumsum(ordered_p.to(tl.float64), 0)
    target = u * tl.max(cdf, 0)
    column = tl.minimum(tl.min(tl.where(cdf >= target, offs, W), 0), W - 1)
    token = tl.sum(tl.where(offs == column, ordered_ids, 0), 0)
    tl.store(out_ids_ptr + row, token)
    tl.store(ok_ptr + row, samplable.to(tl.int8))
    tl.store(rerouted_ptr + row, rerouted.to(tl.int8))


def candidate_sample(
    values: torch.Tensor,
    ids: torch.Tensor,
    table: torch.Tensor,
    vocab: int,
    *,
    has_top_p: bool = True,
    has_min_p: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.candidate_sample` in one launch (one program per row)."""
    batch, width = values.shape
    device = values.device
    out_ids = torch.empty(batch, dtype=torch.int64, device=device)
    ok = torch.empty(batch, dtype=torch.int8, device=device)
    rerouted = torch.empty(batch, dtype=torch.int8, device=device)
    if batch == 0:
        return out_ids, ok.bool(), rerouted.bool()
    padded = triton.next_power_of_2(width)
    if padded != width:
        # Only when the candidates are a small whole vocabulary: -inf columns (probability 0,
        # never drawn) with ids past it (last in id order).
        pad = padded - width
        values = torch.nn.functional.pad(values.float(), (0, pad), value=float("-inf"))
        extra = torch.arange(vocab, vocab + pad, device=device, dtype=ids.dtype)
        ids = torch.cat([ids, extra.expand(batch, pad)], dim=1)
        width = padded
    if values.stride(-1) != 1:
        values = values.contiguous()
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    _candidate_kernel[(batch,)](
        values, ids, table.contiguous(), out_ids, ok, rerouted, values.stride(0), ids.stride(0),
        batch, vocab, W=width, HAS_TOP_P=has_top_p, HAS_MIN_P=has_min_p,
        num_warps=4 if width <= 256 else 8,
    )  # fmt: skip
    return out_ids, ok.bool(), rerouted.bool()
