"""Torch references of the sampler's hot ops: greedy results, the top-k/top-p filter and
draw over whole rows, and the candidate draw over a row's top logits. They define what the
Triton sampling kernels (`triton_sampling`, `triton_top_k_top_p`, `triton_full_row_draw`,
`triton_candidates`) must compute, and they are the CPU path.

Owner: kernels. Re-exported by `metrale.kernels.reference`, where the other hot ops'
references live; the invariants of each function are in its docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's whole result for rows that take the argmax of unprocessed logits.

    Per row of `[B, V]` logits, read as float32 with NaN as -inf and +inf as the float32 max:
    `(token_ids [B] int64, packed [B, 4] float64)`, the token the largest logit's (ties: the
    lowest id; a row without a finite logit: 0) and `packed` its (token id, raw logprob =
    logit - logsumexp of the row (-inf for a row without a finite logit), rank = 1 (nothing
    is larger than the argmax), samplable = 1.0 if the row has a finite logit else 0.0)."""
    f32 = torch.finfo(torch.float32)
    raw = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=f32.max, neginf=float("-inf"))
    values, ids = raw.max(dim=-1)
    lse = torch.logsumexp(raw, dim=-1)
    logprobs = values - lse
    logprobs = torch.where(torch.isnan(logprobs), float("-inf"), logprobs)
    samplable = values > float("-inf")
    packed = torch.stack(
        [ids.double(), logprobs.double(), torch.ones_like(logprobs).double(), samplable.double()],
        dim=1,
    )
    return ids, packed


def stop_masked_greedy(
    logits: torch.Tensor, banned: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's torch-path result for greedy rows whose logits only `banned[r]` change
    (those ids at -inf: min_tokens' stop ids, each in `[0, V)`) and that want no alternatives,
    in `greedy_logprobs`' form: `(token_ids [B] int64, packed [B, 4] float64)` of (token, raw
    logprob, rank, samplable). The token is `argmax` of the masked row (NaN as -inf, +inf kept,
    ties the lowest id), samplable when its value is above -inf, else the raw row's argmax
    (NaN as -inf, +inf as the float32 max); logprob and rank are the token's under the raw
    row read that way (`draw.finish`'s `log_softmax` terms, the rank 1 + the larger logits)."""
    f32 = torch.finfo(torch.float32)
    raw = logits.float()
    masked = raw.clone()
    for r, ids in enumerate(banned):
        masked[r, list(ids)] = float("-inf")
    ids, values = argmax(masked)
    samplable = values > float("-inf")
    clean = torch.nan_to_num(raw, nan=float("-inf"), posinf=f32.max, neginf=float("-inf"))
    ids = torch.where(samplable, ids, clean.argmax(dim=-1))
    chosen = clean.gather(1, ids.unsqueeze(1))
    logprobs = (chosen - torch.logsumexp(clean, dim=-1, keepdim=True)).squeeze(1)
    logprobs = torch.where(torch.isnan(logprobs), float("-inf"), logprobs)
    ranks = (clean > chosen).sum(dim=-1) + 1
    packed = torch.stack(
        [ids.double(), logprobs.double(), ranks.double(), samplable.double()], dim=1
    )
    return ids, packed


def argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `[B, V]`: `(index of the largest logit [B] int64, its value [B] float32)`.

    NaN reads as -inf; ties go to the lowest index; a row of -inf gives index 0, value -inf.
    """
    x = logits.float().masked_fill(torch.isnan(logits), float("-inf"))
    ids = x.argmax(dim=-1)
    return ids, x.gather(1, ids.unsqueeze(1)).squeeze(1)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[M, ceil(vocab / 32)]` int32 words to `[M, vocab]` bool: token `t` allowed when bit
    `t % 32` of word `t // 32` is set (xgrammar's layout; bit 31 is the sign bit)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab] != 0


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`argmax` over each row's allowed tokens: `logits` `[B, V]`, `bitmask` `[B, ceil(V/32)]`
    int32 (`unpack_bitmask`). A forbidden token reads as -inf, and so does NaN; ties go to the
    lowest index; a row without an allowed finite logit gives index 0 and value -inf (the
    greedy draw of the masked logits, without building them)."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return argmax(logits.float().masked_fill(~allowed, float("-inf")))


def apply_token_bitmask(
    x: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`x` `[B, V]` with row `rows[j]` (`[M]` int64; None: row j, M = B) limited to what
    `bitmask[j]` allows, every other logit at -inf; rows not in `rows` unchanged. Out of
    place."""
    forbidden = ~unpack_bitmask(bitmask, x.shape[1])
    if rows is None:
        return x.masked_fill(forbidden, float("-inf"))
    sub = x.index_select(0, rows).masked_fill(forbidden, float("-inf"))
    return x.index_copy(0, rows, sub)


def top_k_top_p_filter(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The filtered probabilities `[B, V]` float32 (0 where filtered, not renormalised) of
    processed logits (penalties, bias and temperature applied; NaN reads as -inf), by a full
    sort; with `samplable [B]` (whether the row has a finite logit; if not, all zeros).

    Per row: top-k (`top_k` <= 0 or >= V: off) keeps every logit >= the k-th largest;
    softmax; min-p (`min_p` <= 0 or None: off) zeroes probabilities < min_p * max; top-p
    (`top_p` >= 1: off) keeps a token while the mass ranked above it (descending, ties by id)
    is < top_p * the remaining mass.
    """
    x = logits.float().masked_fill(torch.isnan(logits), float("-inf"))
    vocab = x.shape[-1]
    k = top_k.to(device=x.device, dtype=torch.int64)
    k = torch.where((k <= 0) | (k >= vocab), vocab, k)
    kth = x.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
    x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    samplable = ~torch.isnan(probs[:, 0])
    probs = torch.nan_to_num(probs, nan=0.0)
    if min_p is not None:
        floor = probs.amax(dim=-1, keepdim=True) * min_p.to(x.device).float().unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    p = top_p.to(device=x.device, dtype=torch.float32).unsqueeze(1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    # float64 sums: in float32 the order of summation decides which token crosses the bound.
    wide = sorted_probs.double()
    mass_above = wide.cumsum(dim=-1) - wide
    total = wide.sum(dim=-1, keepdim=True)
    keep_sorted = (mass_above < total * p.double()) | (p >= 1.0)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return probs.masked_fill(~keep, 0.0), samplable


def top_k_top_p_sample(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    min_p: torch.Tensor | None = None,
    *,
    has_top_k: bool = True,
    has_top_p: bool = True,
    temperature: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row: `top_k_top_p_filter`, then the first token in id order whose
    float64 cumulative probability reaches `uniforms * total` (`uniforms` in (0, 1)); the
    definition the Triton kernel matches. Returns `(token_ids [B] int64, samplable [B]
    bool)`; a row without a finite logit gets token 0 and samplable False.
    `has_top_k` / `has_top_p` are the kernel's launch hints (False: no row has that filter
    on); they never change the result, and the reference does not need them.
    `temperature` (`[B]`, > 0): the logits are divided by it first, then NaN reads as -inf
    and +inf as the float32 max (the sampler's order). `active` (`[B]` bool): rows it
    leaves out give token 0, samplable False (the kernel does not read them).
    """
    if temperature is not None:
        f32 = torch.finfo(torch.float32)
        scale = temperature.to(device=logits.device, dtype=torch.float32).unsqueeze(1)
        logits = torch.nan_to_num(
            logits.float() / scale, nan=float("-inf"), posinf=f32.max, neginf=float("-inf")
        )
    probs, samplable = top_k_top_p_filter(logits, top_k, top_p, min_p)
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniforms.to(device=probs.device, dtype=torch.float64).unsqueeze(1) * cdf[:, -1:]
    ids = torch.searchsorted(cdf, target, right=False).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    if active is not None:
        samplable = samplable & active.to(device=samplable.device, dtype=torch.bool)
    return torch.where(samplable, ids, 0), samplable


def candidate_sample(
    values: torch.Tensor,
    ids: torch.Tensor,
    table: torch.Tensor,
    vocab: int,
    *,
    has_top_p: bool = True,
    has_min_p: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampler's draw on each row's candidates: `values` / `ids` `[B, W]`, a row's `W`
    largest processed (untempered) logits in descending order and their token ids, as
    `torch.topk` gives them (NaN first); `table` `[5, B]` float64: temperature, top_k, top_p,
    min_p, uniform per row (`metrale.sampling.candidates.pack_rows`).

    Per row: temper and sanitize (x / t, then NaN -> -inf, +inf -> float32 max); the top-k
    threshold is the k-th candidate; softmax, min-p, top-p (float64 mass, ties ranked by id)
    and the inverse-CDF draw, all in token-id order over the candidates. Returns `(token_ids
    [B] int64, samplable [B] bool, rerouted [B] bool)`: `rerouted` marks a row the candidates
    cannot hold (a NaN, or its last candidate tied with the threshold while `W < vocab` and
    the threshold is finite), whose token and samplable are then not valid.
    `has_top_p` / `has_min_p` False: no row has that filter on (a neutral filter changes
    nothing either way)."""
    width = values.shape[1]
    f32 = torch.finfo(torch.float32)
    values = values.float()
    has_nan = torch.isnan(values[:, 0])
    tempered = torch.nan_to_num(
        values / table[0].float().unsqueeze(1),
        nan=float("-inf"),
        posinf=f32.max,
        neginf=float("-inf"),
    )
    k = table[1].long().clamp(1, width)
    threshold = tempered.gather(1, (k - 1).unsqueeze(1))
    rerouted = has_nan
    if width < vocab:
        spill = (tempered[:, -1:] >= threshold) & (threshold > float("-inf"))
        rerouted = rerouted | spill.squeeze(1)
    ids, order = ids.sort(dim=-1)  # token-id order: the draw's and top-p's tie order
    tempered = tempered.gather(1, order)
    probs = torch.softmax(tempered.masked_fill(tempered < threshold, float("-inf")), dim=-1)
    samplable = ~torch.isnan(probs[:, 0])
    if has_min_p:
        floor = probs.amax(dim=-1, keepdim=True) * table[3].float().unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    if has_top_p:
        p = table[2].float().unsqueeze(1)
        sorted_probs, perm = probs.sort(dim=-1, descending=True, stable=True)
        wide = sorted_probs.double()
        mass_above = wide.cumsum(dim=-1) - wide
        keep_sorted = (mass_above < wide.sum(dim=-1, keepdim=True) * p.double()) | (p >= 1.0)
        keep = torch.zeros_like(keep_sorted).scatter(-1, perm, keep_sorted)
        probs = probs.masked_fill(~keep, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    target = table[4].double().unsqueeze(1) * cdf[:, -1:]
    column = torch.searchsorted(cdf, target, right=False).clamp_(max=width - 1)
    return ids.gather(1, column).squeeze(1), samplable, rerouted


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, samplable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler's result for drawn tokens, from the RAW logits `[B, V]` (read as float32,
    NaN as -inf, +inf as the float32 max): `(token_ids [B] int64, packed [B, 4] float64)`.

    A row whose `samplable` is False takes the argmax of its raw logits instead (ties: the
    lowest id). `packed` holds (token id, raw logprob = logit - logsumexp of the row, -inf
    for a row without a finite logit; rank = 1 + the number of strictly larger logits;
    samplable as 1.0 / 0.0), the columns `SampledBatch` copies back.
    """
    f32 = torch.finfo(torch.float32)
    raw = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=f32.max, neginf=float("-inf"))
    ok = samplable.to(torch.bool)
    ids = torch.where(ok, token_ids.to(torch.int64), raw.argmax(dim=-1))
    chosen = raw.gather(1, ids.unsqueeze(1))
    logprobs = (chosen - torch.logsumexp(raw, dim=-1, keepdim=True)).squeeze(1)
    logprobs = torch.where(torch.isnan(logprobs), float("-inf"), logprobs)
    ranks = (raw > chosen).sum(dim=-1) + 1
    packed = torch.stack([ids.double(), logprobs.double(), ranks.double(), ok.double()], dim=1)
    return ids, packed


def row_topk(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` largest values of `x` `[N, V]` and their ids, descending (NaN
    first): `torch.topk`. The CUDA form (`triton_row_topk`) may instead mark a row it could
    not finish with NaN as its first value; callers treat a NaN first value as "not exact"."""
    return x.topk(width, dim=-1, sorted=True)
