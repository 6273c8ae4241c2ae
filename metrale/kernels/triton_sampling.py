"""Triton kernels for the sampler's hot path: greedy argmax and the one-pass greedy logprob on
the device. The top-k / min-p / top-p draw without a vocabulary sort lives in
`triton_top_k_top_p`, the draw on top-k candidates in `triton_candidates`; both are
re-exported here.

Owner: kernels. `reference.argmax` and `reference.greedy_logprobs` define the functions;
`tests/gpu/test_kernels.py` checks the kernels against them. The sampler (metrale/sampling)
decides when to call them.

Invariants:
- No host synchronisation; every output element is written; one program per row.
- `argmax`: NaN reads as -inf; ties go to the lowest index (torch.argmax); a row of -inf gives
  index 0 and value -inf.
- `greedy_logprobs`: the argmax (as `argmax`, +inf read as the float32 max) with its raw
  logprob from an online logsumexp, packed as the sampler reads it back; equal to the
  reference up to float32 summation order in the logsumexp.
- `masked_argmax` / `apply_token_bitmask`: the argmax / the logits under a grammar's token
  bitmask (`[rows, ceil(V/32)]` int32, xgrammar's layout), the bits read beside the logits:
  no unpacked mask is built.
- `token_logprobs`: the same one pass for a drawn token (the candidate draw's result): its raw
  logprob, its rank (strictly larger logits counted in the pass) and, for a row the draw
  found unsamplable, the raw argmax instead, packed the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.kernels.triton_candidates import candidate_sample
from metrale.kernels.triton_top_k_top_p import top_k_top_p_filter, top_k_top_p_sample

__all__ = [
    "apply_token_bitmask",
    "argmax",
    "candidate_sample",
    "greedy_logprobs",
    "masked_argmax",
    "token_logprobs",
    "top_k_top_p_filter",
    "top_k_top_p_sample",
]


@triton.jit
def _argmax_kernel(
    x_ptr, m_ptr, ids_ptr, values_ptr, stride_x, stride_m, V,
    HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """The row's argmax; with `HAS_MASK`, every token its bitmask word leaves unset reads as
    -inf (`masked_argmax`)."""
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_id = tl.full([], 0, dtype=tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        keep = x == x  # NaN reads as -inf
        if HAS_MASK:
            word = tl.load(m_ptr + row.to(tl.int64) * stride_m + cols // 32, mask=cols < V, other=0)
            keep = keep & (((word >> (cols % 32)) & 1) != 0)
        x = tl.where(keep, x, float("-inf"))
        chunk_max = tl.max(x, 0)
        chunk_id = tl.min(tl.where(x == chunk_max, cols, V), 0).to(tl.int64)
        better = chunk_max > best
        best_id = tl.where(better, chunk_id, best_id)
        best = tl.where(better, chunk_max, best)
    tl.store(ids_ptr + row, best_id)
    tl.store(values_ptr + row, best)


def argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `[B, V]`: `(index of the largest logit [B] int64, its value [B] float32)`."""
    return _argmax(logits, None)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.masked_argmax` in one launch: one program per row, the bitmask read with it."""
    return _argmax(logits, bitmask.contiguous())


def _argmax(
    logits: torch.Tensor, bitmask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, vocab = logits.shape
    ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    values = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch == 0:
        return ids, values
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    words = bitmask if bitmask is not None else logits
    block = min(4096, triton.next_power_of_2(vocab))
    _argmax_kernel[(batch,)](
        logits, words, ids, values, logits.stride(0), words.stride(0), vocab,
        HAS_MASK=bitmask is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
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


@triton.jit
def _token_logprobs_kernel(
    x_ptr, tok_ptr, ok_ptr, ids_ptr, packed_ptr, stride_x, V, BLOCK: tl.constexpr
):
    """One pass over a row: online logsumexp, running argmax (the unsamplable row's token)
    and the count of logits strictly above the drawn token's."""
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * stride_x
    ok = tl.load(ok_ptr + row) != 0
    tok = tl.load(tok_ptr + row).to(tl.int64)
    tok = tl.minimum(tl.maximum(tok, 0), V - 1)
    v_tok = tl.load(base + tok).to(tl.float32)
    v_tok = tl.where(v_tok != v_tok, float("-inf"), v_tok)
    v_tok = tl.minimum(v_tok, 3.4028234663852886e38)
    best = tl.full([], float("-inf"), dtype=tl.float32)
    best_id = tl.full([], 0, dtype=tl.int64)
    total = tl.full([], 0.0, dtype=tl.float32)
    above = tl.full([], 0, dtype=tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)
        x = tl.minimum(x, 3.4028234663852886e38)
        above += tl.sum((x > v_tok).to(tl.int64), 0)
        chunk_max = tl.max(x, 0)
        chunk_id = tl.min(tl.where(x == chunk_max, cols, V), 0).to(tl.int64)
        better = chunk_max > best
        new_best = tl.maximum(best, chunk_max)
        if new_best > float("-inf"):
            total = total * tl.exp(best - new_best) + tl.sum(tl.exp(x - new_best), 0)
        best_id = tl.where(better, chunk_id, best_id)
        best = new_best
    lse = best + tl.log(total)
    value = tl.where(ok, v_tok, best)
    logprob = value - lse
    logprob = tl.where(logprob != logprob, float("-inf"), logprob)
    rank = tl.where(ok, above + 1, 1)
    token = tl.where(ok, tok, best_id)
    tl.store(ids_ptr + row, token)
    out = packed_ptr + row.to(tl.int64) * 4
    tl.store(out, token.to(tl.float64))
    tl.store(out + 1, logprob.to(tl.float64))
    tl.store(out + 2, rank.to(tl.float64))
    tl.store(out + 3, tl.where(ok, 1.0, 0.0).to(tl.float64))


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, samplable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.token_logprobs` in one launch: one program per row, one pass over it."""
    batch, vocab = logits.shape
    ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
    packed = torch.empty((batch, 4), dtype=torch.float64, device=logits.device)
    if batch == 0:
        return ids, packed
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = min(4096, triton.next_power_of_2(vocab))
    _token_logprobs_kernel[(batch,)](
        logits, token_ids.contiguous(), samplable.to(torch.int8).contiguous(), ids, packed,
        logits.stride(0), vocab, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return ids, packed


@triton.jit
def _apply_bitmask_kernel(
    x_ptr, out_ptr, m_ptr, rows_ptr, stride_x, stride_o, stride_m, V,
    HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One block of one masked row: `out[row] = x[row]` where the bit is set, else -inf."""
    j = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    if HAS_ROWS:
        row = tl.load(rows_ptr + j).to(tl.int64)
    else:
        row = j.to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside)
    word = tl.load(m_ptr + j.to(tl.int64) * stride_m + cols // 32, mask=inside, other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    x = tl.where(allowed, x, float("-inf"))
    tl.store(out_ptr + row * stride_o + cols, x.to(out_ptr.dtype.element_ty), mask=inside)


def apply_token_bitmask(
    x: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`reference.apply_token_bitmask` in one launch (a copy of `x` first when only some
    rows are masked)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    count = bitmask.shape[0]
    out = torch.empty_like(x) if rows is None else x.clone()
    if count == 0 or x.shape[1] == 0:
        return out
    bitmask = bitmask.contiguous()
    block = 2048
    grid = (count, triton.cdiv(x.shape[1], block))
    _apply_bitmask_kernel[grid](
        x, out, bitmask, rows if rows is not None else bitmask, x.stride(0), out.stride(0),
        bitmask.stride(0), x.shape[1], HAS_ROWS=rows is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out
