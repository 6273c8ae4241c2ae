"""The sampler's stages as functions over a batch of rows: sanitizing logits, raw logprobs
and ranks, temperature, the torch path's filters and probabilities, the draw's finish
(logprobs, ranks and top alternatives of the chosen tokens) and greedy argmax. `Sampler`
(`metrale.sampling.sampler`) and lossless draft verification (`metrale.sampling.verify`)
compose them; the pipeline and its invariants are stated in `metrale.sampling.sampler`.

Owner: sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from metrale.sampling.logits_processors import apply_min_p, apply_top_k, apply_top_p
from metrale.sampling.processing import apply_to_rows, to_device
from metrale.sampling.result import SampledBatch

if TYPE_CHECKING:
    from metrale.kernels import KernelOps
    from metrale.sampling.sampler import SamplingRow

NEG_INF = float("-inf")
FLOAT32_MAX = torch.finfo(torch.float32).max


def sanitize(x: Tensor) -> Tensor:
    """NaN -> -inf (not samplable), +inf -> the largest float (the most likely token)."""
    return torch.nan_to_num(x, nan=NEG_INF, posinf=FLOAT32_MAX, neginf=NEG_INF)


def gather_logprobs(
    logits: Tensor, token_ids: Tensor, num_top: int
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Raw logprobs of `token_ids` under `logits` `[N, V]`, their ranks, and the top alternatives.

    Returns `(logprobs [N], ranks [N] (1-based), top_ids [N, num_top], top_logprobs [N,
    num_top])` (the last two None when `num_top == 0`), all from `log_softmax(logits.float())`.
    NaN logits count as -inf; a row without any finite logit gets -inf logprobs. Used for the
    sampled tokens and, by the engine, for prompt logprobs.
    """
    return gather_raw_logprobs(sanitize(logits.float()), token_ids, num_top)


def gather_raw_logprobs(
    raw: Tensor, token_ids: Tensor, num_top: int
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """`gather_logprobs` over logits already in float32 and sanitized."""
    lse = torch.logsumexp(raw, dim=-1, keepdim=True)
    chosen = raw.gather(1, token_ids.to(torch.int64).unsqueeze(1))
    logprobs = (chosen - lse).squeeze(1)
    logprobs = torch.where(torch.isnan(logprobs), NEG_INF, logprobs)
    ranks = (raw > chosen).sum(dim=-1) + 1
    if num_top <= 0:
        return logprobs, ranks, None, None
    top_values, top_ids = raw.topk(min(num_top, raw.shape[-1]), dim=-1, sorted=True)
    top_logprobs = top_values - lse
    top_logprobs = torch.where(torch.isnan(top_logprobs), NEG_INF, top_logprobs)
    return logprobs, ranks, top_ids, top_logprobs


def temper(x: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Processed logits of non-greedy rows divided by their temperature, then sanitized."""
    temperatures = [row.params.temperature for row in rows]
    if any(t != 1.0 for t in temperatures):
        x = x / to_device(temperatures, torch.float32, x.device).unsqueeze(1)
    return sanitize(x)


def filter_rows(x: Tensor, rows: Sequence[SamplingRow]) -> tuple[Tensor, Tensor]:
    """Top-k, softmax, min-p and top-p over tempered logits (the torch path): `(probs [N, V]`
    non-negative and unnormalised, the distribution the row's draw uses; `samplable [N])`."""
    vocab = x.shape[1]
    device = x.device
    top_k_rows = [j for j, row in enumerate(rows) if row.params.top_k_filters(vocab)]
    max_k = max((rows[j].params.top_k for j in top_k_rows), default=0)
    if top_k_rows:
        ks = to_device([rows[j].params.top_k for j in top_k_rows], torch.int64, device)
        x = apply_to_rows(x, top_k_rows, lambda sub: apply_top_k(sub, ks, max_k))

    probs = torch.softmax(x, dim=-1)
    # A row with no finite logit softmaxes to NaN everywhere; any finite logit gives none.
    samplable = ~torch.isnan(probs[:, 0])

    min_p_rows = [j for j, row in enumerate(rows) if row.params.min_p_enabled]
    if min_p_rows:
        min_ps = to_device([rows[j].params.min_p for j in min_p_rows], torch.float32, device)
        probs = apply_to_rows(probs, min_p_rows, lambda sub: apply_min_p(sub, min_ps))

    top_p_rows = [j for j, row in enumerate(rows) if row.params.top_p_enabled]
    if top_p_rows:
        top_ps = to_device([rows[j].params.top_p for j in top_p_rows], torch.float32, device)
        # Rows whose top-k already ran hold about k candidates: sort only those.
        candidates = None
        if all(rows[j].params.top_k_filters(vocab) for j in top_p_rows):
            candidates = max(rows[j].params.top_k for j in top_p_rows)
        probs = apply_to_rows(probs, top_p_rows, lambda sub: apply_top_p(sub, top_ps, candidates))
    return probs, samplable


def probabilities(x: Tensor, rows: Sequence[SamplingRow]) -> tuple[Tensor, Tensor]:
    """The distribution `Sampler._draw` draws non-greedy rows from (after stage 1):
    temperature, top-k, softmax, min-p, top-p. `(probs, samplable)` as `filter_rows`."""
    return filter_rows(temper(x, rows), rows)


def finish(
    raw: Tensor,
    token_ids: Tensor,
    samplable: Tensor,
    top_counts: Sequence[int],
    max_top: int,
    emitted: Tensor | None = None,
) -> SampledBatch:
    """The result: unsamplable rows' fallback token (raw argmax), then raw logprobs, ranks and
    the `max_top` top alternatives of `token_ids` under `raw` (float32, not yet sanitized);
    `top_counts`: per row, the alternatives it asked for."""
    raw = sanitize(raw)
    token_ids = torch.where(samplable, token_ids, raw.argmax(dim=-1))
    logprobs, ranks, top_ids, top_logprobs = gather_raw_logprobs(raw, token_ids, max_top)
    return SampledBatch(
        token_ids=token_ids,
        logprobs=logprobs,
        ranks=ranks,
        samplable=samplable,
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
        top_counts=[min(count, max_top) for count in top_counts],
        emitted=emitted,
    )


def plain_greedy(row: SamplingRow) -> bool:
    """A greedy row whose logits nothing changes first (no penalty, bias, min_tokens mask,
    bad word, allowed-token list or grammar) and that wants no alternatives: its token is the
    argmax of the raw logits."""
    return row.grammar is None and _unprocessed_greedy(row)


def grammar_greedy(row: SamplingRow) -> bool:
    """A greedy row that only its grammar constrains (`plain_greedy` but for the grammar; not
    a verify position, no pending token): its token is the argmax of the raw logits over the
    tokens the grammar allows."""
    return (
        row.grammar is not None
        and row.grammar_committed is None
        and not row.pending
        and _unprocessed_greedy(row)
    )


def stop_masked_greedy(row: SamplingRow) -> bool:
    """A greedy row whose logits only min_tokens' stop-id mask may change (`plain_greedy` but
    for that mask; `stop_mask` lists its ids): its token is the argmax of the raw logits
    without them."""
    return row.grammar is None and _unprocessed_greedy(row, stops_masked=True)


def stop_mask(row: SamplingRow, vocab: int) -> list[int]:
    """The ids `process_logits` masks for a `stop_masked_greedy` row: its stop ids while
    `stop_tokens_allowed` is False (those in `[0, vocab)`), else none."""
    params = row.params
    if params.stop_tokens_allowed(row.step):
        return []
    masked = params.masked_stop_token_ids(row.eos_token_ids)
    return sorted(token for token in masked if 0 <= token < vocab)


def _unprocessed_greedy(row: SamplingRow, stops_masked: bool = False) -> bool:
    """A greedy row that nothing processes first (`stops_masked`: but min_tokens' stop-id
    mask, if it holds)."""
    params = row.params
    return (
        params.is_greedy
        and not params.uses_penalties
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not params.bad_words_token_ids
        and (stops_masked or params.stop_tokens_allowed(row.step))
        and not params.logprobs
    )


def greedy(x: Tensor, ops: KernelOps | None = None) -> tuple[Tensor, Tensor]:
    """Argmax (ties: lowest id; NaN reads as -inf) and whether the row had a finite logit.

    With `ops`, one `ops.argmax` launch, which reads NaN as -inf and breaks ties by the lowest
    id too; a row without a finite logit gets value -inf, so it is not samplable either way.
    (It ranks +inf above float32 max, where `sanitize` makes them equal; see the module
    docstring.)
    """
    if ops is not None:
        token_ids, values = ops.argmax(x)
        return token_ids, values > NEG_INF
    values, token_ids = sanitize(x).max(dim=-1)
    return token_ids, values > NEG_INF
