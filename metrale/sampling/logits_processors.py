"""Logits processors: penalties, logit bias, token masks and the top-k / min-p / top-p filters.

Owner: sampling. Each function is a small pure function over batched tensors (one row per
sequence being sampled) that the sampler composes; each is usable and testable alone.

Invariants:
- No function modifies its inputs: each returns a new tensor (the caller's logits, which may
  be the model's logits buffer, are never written).
- Per-row parameters are either a Python float (the same for every row) or a 1-D tensor with
  one value per row on the logits' device; a neutral value (penalty 1.0, frequency/presence
  0.0, top_p 1.0, min_p 0.0) leaves a row bit-identical.
- No function synchronises with the device (no `.item()`, no boolean-mask indexing, no
  data-dependent shapes): all run inside an asynchronous CUDA stream.
- Token ids given to `apply_logit_bias` / `mask_tokens` must lie in `[0, vocab)`; the sampler
  filters them on the host. `token_counts` ignores ids outside `[0, vocab)` itself.
- Filters never remove every token of a row that has a finite logit: top-k keeps the top
  `k >= 1`, min-p and top-p always keep the most likely token.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "apply_frequency_presence",
    "apply_logit_bias",
    "apply_min_p",
    "apply_repetition_penalty",
    "apply_top_k",
    "apply_top_p",
    "mask_tokens",
    "token_counts",
]


def _per_row(value: float | Tensor, like: Tensor) -> float | Tensor:
    """A scalar stays a scalar; a `[N]` tensor becomes a `[N, 1]` column of `like`'s dtype."""
    if isinstance(value, Tensor):
        return value.to(device=like.device, dtype=like.dtype).reshape(-1, 1)
    return float(value)


def token_counts(
    row_ids: Tensor, token_ids: Tensor, num_rows: int, vocab_size: int, dtype: torch.dtype
) -> Tensor:
    """`[num_rows, vocab_size]` occurrence counts of `token_ids[i]` in row `row_ids[i]`.

    `row_ids` and `token_ids` are flat 1-D int64 tensors of equal length (every token of every
    row, concatenated). Token ids outside `[0, vocab_size)` are not counted.
    """
    width = vocab_size + 1  # the last column absorbs out-of-range ids
    valid = (token_ids >= 0) & (token_ids < vocab_size)
    columns = torch.where(valid, token_ids, vocab_size)
    flat_index = row_ids * width + columns
    counts = torch.zeros(num_rows * width, dtype=dtype, device=row_ids.device)
    counts.index_add_(0, flat_index, torch.ones_like(flat_index, dtype=dtype))
    return counts.view(num_rows, width)[:, :vocab_size]


def apply_repetition_penalty(logits: Tensor, token_mask: Tensor, penalty: float | Tensor) -> Tensor:
    """The HF / vLLM repetition penalty over the tokens where `token_mask` is True.

    A positive logit is divided by the penalty, a zero or negative one multiplied by it, so a
    penalty > 1 always makes a seen token less likely. `token_mask` is `[N, V]` bool (the token
    occurs in the row's prompt or output); `penalty` a float or `[N]`.
    """
    p = _per_row(penalty, logits)
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(token_mask, penalised, logits)


def apply_frequency_presence(
    logits: Tensor,
    counts: Tensor,
    frequency_penalty: float | Tensor,
    presence_penalty: float | Tensor,
) -> Tensor:
    """The OpenAI rule: `logit -= count * frequency_penalty + (count > 0) * presence_penalty`.

    `counts` is `[N, V]`: how often each token occurs in the row's generated output.
    """
    counts = counts.to(logits.dtype)
    freq = _per_row(frequency_penalty, logits)
    pres = _per_row(presence_penalty, logits)
    present = (counts > 0).to(logits.dtype)
    return logits - (counts * freq + present * pres)


def apply_logit_bias(logits: Tensor, row_ids: Tensor, token_ids: Tensor, bias: Tensor) -> Tensor:
    """Add `bias[i]` to `logits[row_ids[i], token_ids[i]]` (sparse; pairs are unique)."""
    rows, vocab = logits.shape
    flat_index = row_ids * vocab + token_ids
    flat = logits.contiguous().view(-1)
    return flat.scatter_add(0, flat_index, bias.to(logits.dtype)).view(rows, vocab)


def mask_tokens(
    logits: Tensor, row_ids: Tensor, token_ids: Tensor, value: float = float("-inf")
) -> Tensor:
    """Set `logits[row_ids[i], token_ids[i]]` to `value` (-inf: the token cannot be sampled)."""
    rows, vocab = logits.shape
    flat_index = row_ids * vocab + token_ids
    flat = logits.contiguous().view(-1)
    return flat.scatter(0, flat_index, value).view(rows, vocab)


def apply_top_k(logits: Tensor, top_k: Tensor, max_k: int) -> Tensor:
    """Mask (-inf) every logit below the row's k-th largest; `top_k` is `[N]` int, k >= 1.

    `max_k` is the largest k of the batch, passed from the host so no device sync is needed.
    Tokens tied with the k-th largest logit are all kept. k >= V keeps every token.
    """
    vocab = logits.shape[-1]
    max_k = max(1, min(int(max_k), vocab))
    k = top_k.to(device=logits.device, dtype=torch.int64).clamp(1, max_k)
    top_values = logits.topk(max_k, dim=-1, sorted=True).values
    threshold = top_values.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p(probs: Tensor, min_p: float | Tensor) -> Tensor:
    """Zero every probability below `min_p` times the row's largest (the top token stays)."""
    threshold = probs.amax(dim=-1, keepdim=True) * _per_row(min_p, probs)
    return probs.masked_fill(probs < threshold, 0.0)


def apply_top_p(probs: Tensor, top_p: float | Tensor, max_candidates: int | None = None) -> Tensor:
    """Top-p over `probs` `[N, V]` (non-negative, unnormalised) as
    `reference.top_k_top_p_filter` and the Triton kernel define it: a token stays while the
    mass ranked above it (descending, ties ranked by token id) is < `top_p * total`, masses
    summed in float64 (float32 sums in different orders disagree about the token that crosses
    the bound); `top_p` a float or `[N]`. The top token is always kept.

    `max_candidates`, when given, says each row passed a top-k of at most that k: only the
    `candidates` largest probabilities are sorted. More tokens than that survive top-k when
    some tie with the k-th largest logit; those all share the smallest candidate probability,
    so the boundary is found on the sorted candidates and the tokens tied with it are then
    kept in id order as many as the mass allows (as the kernel does) - the same kept set.
    """
    vocab = probs.shape[-1]
    candidates = max_candidates
    if isinstance(top_p, Tensor):
        p = top_p.to(device=probs.device, dtype=torch.float32).unsqueeze(1)
    else:
        p = torch.full((probs.shape[0], 1), float(top_p), device=probs.device)
    bound_scale = p.double()
    if candidates is None or candidates >= vocab:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        wide = sorted_probs.double()
        mass_above = wide.cumsum(dim=-1) - wide
        total = wide.sum(dim=-1, keepdim=True)
        keep_sorted = (mass_above < total * bound_scale) | (p >= 1.0)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        return probs.masked_fill(~keep, 0.0)
    sorted_probs = probs.topk(max(1, candidates), dim=-1, sorted=True).values
    wide = sorted_probs.double()
    bound = probs.double().sum(dim=-1, keepdim=True) * bound_scale
    kept = ((wide.cumsum(dim=-1) - wide) < bound).sum(dim=-1, keepdim=True)
    # The smallest kept probability (the top one is always kept; a NaN row keeps nothing).
    boundary = sorted_probs.gather(-1, (kept - 1).clamp(min=0))
    above = probs > boundary
    mass_above = torch.where(above, probs, 0.0).double().sum(dim=-1, keepdim=True)
    ties = probs == boundary
    tie_rank = ties.cumsum(dim=-1) - 1  # rank among the boundary ties, in token-id order
    # The i-th tie (0-based) has mass_above + i * boundary ranked above it.
    keep_ties = ((bound - mass_above) / boundary.double()).ceil().clamp(min=1.0)
    keep = above | (ties & (tie_rank < keep_ties)) | (p >= 1.0)
    return probs.masked_fill(~keep, 0.0)
