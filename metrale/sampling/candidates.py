"""The candidate draw: the sampler's fast path for rows with a small top-k, on their top
candidates only instead of the whole vocabulary.

Owner: sampling (`Sampler.sample` decides when a batch takes it; see `eligible`). The function
is the sampler's (`metrale.sampling.sampler`'s module docstring): temperature, top-k (every
logit >= the k-th largest stays, ties included), softmax, min-p, top-p (float64 mass, ties
ranked by token id), the inverse-CDF draw in token-id order with the row's uniform. Here each
row is first cut to its `width` largest processed logits (`KernelOps.row_topk`: four Triton
launches on CUDA, `torch.topk` elsewhere), and every later stage runs on that `[N, width]` tensor, in one launch on CUDA
(`KernelOps.candidate_sample`: `kernels/triton_candidates.py`), by torch ops elsewhere
(`kernels/reference.candidate_sample`):

1. the candidates are tempered and sanitized exactly as the full row would be (the same
   elementwise division, so the same values), and ordered by token id;
2. the top-k threshold is the k-th candidate value (tempering is monotone, so the k-th largest
   tempered logit is the tempered k-th largest logit);
3. softmax, min-p, top-p (the full-sort form: on `width` columns a sort is cheap) and the draw
   run on the id-ordered candidates, whose float64 cumulative sums are the full row's with
   its zeros left out.

A row is exact on its candidates when every token the top-k keeps is one of them: when its
last candidate is below the threshold (or the threshold is -inf: fewer than k finite logits,
all candidates), or when `width` is the whole vocabulary. Otherwise (more tokens tie at the
k-th largest logit than the candidates hold; in float32 logits of a bf16 model that takes
`width - k` ties, with `width >= 2k`) the row is *re-routed*, as is a row holding a NaN logit
(`topk` ranks NaN first), or a row the CUDA cut could not finish (it marks it NaN; see
`kernels/triton_row_topk.py`): its token comes from the full-row draw, so the result never depends
on the shortcut. Re-routed rows are counted (`Sampler.stats`) and reported
(`SamplerOutput.rerouted_rows`).

Greedy rows of a batch that takes this path ride along as top-k 1 rows at temperature 1 with
the smallest uniform: their draw is the first token in id order among those tied at the
largest logit, i.e. the argmax (ties: lowest id), with no index_select of the batch.

Invariants:
- Bit for bit, each exact row's candidates hold the values the torch path's full row holds
  at those tokens, and the other tokens' probabilities are 0 there; only float32 softmax
  normalisers and float64 totals are summed in another order (as between the torch path and
  the kernel), so a seeded row draws the same token unless its uniform falls within rounding
  of a cumulative boundary.
- No host<->device synchronisation on CUDA: the per-row parameters go up in one pinned
  copy (`pack_rows`), and re-routed rows are drawn by the sync-free full-row kernel limited
  to them (`KernelOps.top_k_top_p_sample(..., active=)`, one launch); only on the CPU, where
  nothing is asynchronous, does the caller look at which rows to re-route.
- The caller's logits are never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from metrale.kernels import reference
from metrale.sampling.processing import to_device

if TYPE_CHECKING:
    from metrale.kernels import KernelOps
    from metrale.sampling.params import SamplingParams

__all__ = [
    "K_MAX",
    "candidate_draw",
    "candidate_width",
    "eligible",
    "inverse_cdf",
    "pack_rows",
]

#: Largest top-k the candidate draw takes (a row with a larger k, or none, keeps the full-row
#: paths): `torch.topk` of up to 2 * K_MAX columns stays cheap against a vocabulary sort.
K_MAX = 1024
#: Fewest candidates per row.
_MIN_WIDTH = 64
#: The uniform of a greedy row riding along: the first kept token in id order.
_FIRST = 2.0**-60


def eligible(params: SamplingParams, vocab: int) -> bool:
    """Whether a row may take the candidate draw: greedy, or a top-k of 1..K_MAX that filters
    (k < vocab). Penalties, bias and masks are fine: they run first, on the full row."""
    return params.is_greedy or (params.top_k_filters(vocab) and params.top_k <= K_MAX)


def candidate_width(max_k: int, vocab: int) -> int:
    """Candidates per row for a batch whose largest k is `max_k`: twice that (room for ties at
    the k-th logit), rounded up to a power of two (few `topk` shapes), at most the vocabulary."""
    width = _MIN_WIDTH
    while width < 2 * max_k:
        width *= 2
    return min(width, vocab)


def pack_rows(
    params: Sequence[SamplingParams], uniforms: Sequence[float], device: torch.device
) -> Tensor:
    """The per-row parameters as one `[5, N]` float64 tensor on `device` (one pinned copy):
    temperature, top_k, top_p, min_p, uniform. Greedy rows get (1, 1, 1, 0, 2**-60). Each row
    of the result is contiguous, so it passes straight to a kernel as a per-row vector."""
    columns: list[float] = []
    for p in params:
        if p.is_greedy:
            columns += [1.0, 1.0, 1.0, 0.0]
        else:
            columns += [p.temperature, float(p.top_k), p.top_p, p.min_p]
    table = torch.tensor(columns, dtype=torch.float64).view(-1, 4).t()
    table = torch.cat([table, torch.tensor([list(uniforms)], dtype=torch.float64)], dim=0)
    return to_device(table.contiguous(), torch.float64, device)


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Per row, the first column whose cumulative probability reaches `uniforms * total`.

    `probs` `[N, C]` are non-negative (unnormalised is fine), `uniforms` `[N]` in (0, 1). The
    cumulative sum is float64, so even tokens far below float32's resolution of the total keep
    their probability. Zero-probability columns are never chosen: the target is > 0 and the
    cumulative sum does not rise at them. Rows of NaN give some column in range (the caller
    replaces unsamplable rows).
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniforms.to(torch.float64).unsqueeze(1) * cdf[:, -1:]
    columns = torch.searchsorted(cdf, target, right=False).squeeze(1)
    return columns.clamp_(max=probs.shape[-1] - 1)


def candidate_draw(
    x: Tensor,
    table: Tensor,
    width: int,
    has_top_p: bool,
    has_min_p: bool,
    ops: KernelOps | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The draw of every row of processed logits `x` `[N, V]` (untempered, unsanitized) on
    its `width` largest logits; `table` from `pack_rows`. Returns `(token_ids [N] int64,
    samplable [N] bool, rerouted [N] bool)`: a `rerouted` row's token and samplable flag are
    not valid (the caller draws it on the full row). `has_top_p` / `has_min_p`: whether any
    row has that filter on (host knowledge; skipping a neutral filter changes nothing).
    The stages after `torch.topk` are `ops.candidate_sample` (one Triton launch on CUDA),
    else `reference.candidate_sample` (torch)."""
    # descending; NaN ranks first (and the CUDA cut marks a row it cannot finish with NaN)
    values, ids = reference.row_topk(x, width) if ops is None else ops.row_topk(x, width)
    sample = reference.candidate_sample if ops is None else ops.candidate_sample
    return sample(values, ids, table, x.shape[1], has_top_p=has_top_p, has_min_p=has_min_p)


def greedy_uniform() -> float:
    """The uniform a greedy row riding along draws with (its argmax; see the module doc)."""
    return _FIRST
