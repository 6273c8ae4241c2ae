"""Lossless verification of draft tokens: greedy acceptance and rejection sampling.

Owner: sampling. `Sampler.verify` calls `verify`; the engine's speculative step hands it the
target's logits for every position of every sequence and the drafts (one-hot proposals: the
proposer's q is a point mass on each draft token, as for prompt lookup or argmax MTP).

Layout: row `i` owns logits rows `offsets[i] .. offsets[i] + k_i` (`k_i = len(drafts[i])`,
`offsets` the prefix sums of `k_j + 1`); logits row `offsets[i] + j` is the target's
distribution for the token after the row's committed tokens plus `drafts[i][:j]`. The result
is a `SampledBatch` with one entry per logits row (position) and `emitted` `[N]` bool.

Per position `j` the processed distribution `p_j` is exactly the one `Sampler.sample` would use
for that sequence had `drafts[i][:j]` already been appended to its output: the sequence is
expanded into `k_i + 1` `SamplingRow`s (penalties see output + drafts[:j], min_tokens and the
seeded counter see `step + j`), and the sampler's own stage 1 (`processing.process_logits`)
and distribution (`draw.probabilities`, the one `Sampler._draw` draws from: temperature,
top-k, softmax, min-p, top-p) run on them.

- Greedy rows: the target token at `j` is the processed argmax (ties: lowest id); draft `j` is
  accepted iff it equals it. The token at every position is that argmax.
- Sampled rows (Leviathan et al. 2023; Chen et al. 2023, with q one-hot): draft `d` at `j < k_i`
  is accepted iff `u_acc < p_j(d)` (`accept_drafts`); otherwise the token at `j` is drawn from
  `p_j` with `d` zeroed (the residual `max(p - q, 0)`, renormalised) by the sampler's
  inverse-CDF draw with `u_draw`. At `j = k_i` (the bonus) the token is the ordinary draw from
  `p_{k_i}` with `u_draw`. So P(token at j = y | emitted) = min(p(y), q(y)) + (1 - p(d)) *
  residual(y) = p_j(y): every emitted token is distributed exactly as without speculation.
- Emission: a row emits positions `0 .. a_i`, `a_i` = its number of leading accepted drafts;
  `emitted` is computed on the device (exclusive cumulative count of rejections per row). A
  position with no samplable token (no finite processed logit) takes the sampler's fallback
  (raw argmax, `samplable` False, listed in `unsamplable_rows`), is never "accepted", and so is
  the row's last emitted position.

Invariants:
- Uniforms, per position `j` of a row, `step_j = row.step + j`: a seeded row's acceptance
  uniform is `row_uniform(mix_seed(seed, ACCEPT_SALT), step_j)` and its draw uniform
  `row_uniform(seed, step_j)`, the one `Sampler.sample` would draw with at that step. Both are
  pure functions of (seed, step), so a seeded row's verify is reproducible and independent of
  its neighbours and batch position; a row with no drafts draws exactly as `sample` does. The
  uniforms of step t only decide the token of output index t, so re-verifying a step after a
  rejection (the next call starts at the first unemitted step) reuses no revealed randomness.
  Unseeded sampled rows take theirs from the sampler's host `random.Random`, in row order and,
  within a row, per position: acceptance (if j < k_i) then draw; greedy rows take none. A batch
  of rows without drafts consumes the stream exactly as `sample` does.
- Logprobs, ranks and top alternatives describe each position's token under the RAW logits row,
  as `sample` reports them (`gather_logprobs`).
- No host<->device synchronisation: host data (drafts, parameters, uniforms, row layout) goes
  up through the sampler's pinned, non-blocking copies; the accept decisions and `emitted` are
  device tensors. Verify always takes the torch path for the distribution (it needs `p_j`
  itself, not only a draw); greedy rows use `ops.argmax` as `sample` does, and a batch of
  plain greedy rows (nothing processes their logits, no alternatives asked for) takes one
  `ops.greedy_logprobs` launch over every position, as `sample` does for such rows.
- The caller's logits tensor is never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from metrale.errors import MetraleError
from metrale.sampling.candidates import inverse_cdf as _inverse_cdf
from metrale.sampling.draw import finish as _finish
from metrale.sampling.draw import greedy as _greedy
from metrale.sampling.draw import plain_greedy as _plain_greedy
from metrale.sampling.draw import probabilities as _probabilities
from metrale.sampling.params import mix_seed
from metrale.sampling.processing import process_logits, to_device
from metrale.sampling.result import SampledBatch
from metrale.sampling.sampler import SamplingRow, row_uniform

if TYPE_CHECKING:
    from metrale.sampling.sampler import Sampler

__all__ = ["ACCEPT_SALT", "accept_drafts", "greedy_accepts", "verify"]

#: Mixed into a seeded row's seed for its acceptance uniforms, so they are independent of the
#: draw uniforms `row_uniform(seed, step)` of the same steps.
ACCEPT_SALT = 0x5EC_ACCE97


def accept_drafts(probs: Tensor, draft_ids: Tensor, uniforms: Tensor) -> Tensor:
    """Rejection sampling's test for a one-hot proposer: accept draft `d` iff `u < p(d)`.

    `probs` `[M, V]` non-negative, unnormalised (the processed distribution); `draft_ids` `[M]`
    int64 in range; `uniforms` `[M]` float64 in (0, 1). Returns `[M]` bool; a row of NaN
    (unsamplable) or with `p(d) = 0` never accepts. Compared in float64 as `u * total < p(d)`.
    """
    wide = probs.to(torch.float64)
    p_draft = wide.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    return uniforms.to(torch.float64) * wide.sum(dim=-1) < p_draft


def verify(
    sampler: Sampler,
    logits: Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    pending_tokens: Tensor | None = None,
) -> SampledBatch:
    """Verify `drafts` against the target's `logits`; see the module docstring.

    `pending_tokens` (`[len(rows)]` int64 on the device) as in `Sampler.sample`: each row's
    token not yet in `output_token_ids`; required when a row with penalties has `pending`.
    Raises `MetraleError` when the shapes do not match or a draft token is out of range.
    """
    if len(drafts) != len(rows):
        raise MetraleError(f"verify got drafts for {len(drafts)} rows and {len(rows)} rows")
    expected = sum(len(d) for d in drafts) + len(rows)
    if logits.dim() != 2 or logits.shape[0] != expected:
        raise MetraleError(
            f"verify got logits of shape {tuple(logits.shape)} for {len(rows)} rows with "
            f"{expected - len(rows)} drafts (needs {expected} logits rows)"
        )
    positions, vocab = logits.shape
    device = logits.device
    if positions == 0:
        empty = sampler.sample(logits, [])
        empty.emitted = torch.empty(0, dtype=torch.bool, device=device)
        return empty
    if sampler._ops is not None and all(map(_plain_greedy, rows)):
        return _verify_plain_greedy(sampler, logits, drafts)

    # Host layout: one expanded row per position, its draft (0 at the bonus), its row's start.
    expanded: list[SamplingRow] = []
    draft_at: list[int] = []
    has_draft: list[bool] = []
    starts: list[int] = []
    owners: list[int] = []
    for i, (row, draft) in enumerate(zip(rows, drafts)):
        tokens = [int(t) for t in draft]
        if any(t < 0 or t >= vocab for t in tokens):
            raise MetraleError(f"verify got a draft token outside [0, {vocab}) in row {i}")
        start = len(expanded)
        expanded.extend(_expand(row, tokens))
        draft_at.extend(tokens)
        draft_at.append(0)
        has_draft.extend([True] * len(tokens))
        has_draft.append(False)
        starts.extend([start] * (len(tokens) + 1))
        owners.extend([i] * (len(tokens) + 1))

    pending = None
    if pending_tokens is not None:
        pending = pending_tokens.index_select(0, to_device(owners, torch.int64, device))
    raw = logits.float()  # may alias the caller's tensor: only out-of-place ops below
    x = process_logits(raw, expanded, pending, sampler._ops)

    draft_ids = to_device(draft_at, torch.int64, device)
    drafted = to_device(has_draft, torch.bool, device)
    greedy = [p for p, row in enumerate(expanded) if row.params.is_greedy]
    sampled = [p for p, row in enumerate(expanded) if not row.params.is_greedy]

    def score(subset: list[int], index: Tensor | None, greedy_rows: bool) -> tuple[Tensor, ...]:
        """`(token_ids, accepted, samplable)` of the positions `subset` (`index` on the
        device; None: all of them)."""
        sub_x, sub_drafts, sub_drafted = x, draft_ids, drafted
        if index is not None:
            sub_x = x.index_select(0, index)
            sub_drafts = draft_ids.index_select(0, index)
            sub_drafted = drafted.index_select(0, index)
        if greedy_rows:
            return _verify_greedy(sampler, sub_x, sub_drafts, sub_drafted)
        sub_rows = [expanded[p] for p in subset]
        sub_has = [has_draft[p] for p in subset]
        return _verify_sampled(sampler, sub_x, sub_rows, sub_has, sub_drafts, sub_drafted)

    if not sampled or not greedy:
        token_ids, accepted, samplable = score(list(range(positions)), None, not sampled)
    else:
        token_ids = torch.empty(positions, dtype=torch.int64, device=device)
        accepted = torch.empty(positions, dtype=torch.bool, device=device)
        samplable = torch.empty(positions, dtype=torch.bool, device=device)
        for subset, greedy_rows in ((greedy, True), (sampled, False)):
            index = to_device(subset, torch.int64, device)
            for out, part in zip(
                (token_ids, accepted, samplable), score(subset, index, greedy_rows)
            ):
                out.index_copy_(0, index, part)

    emitted = _emitted(accepted, to_device(starts, torch.int64, device))

    top_counts = [row.params.logprobs or 0 for row in expanded]
    max_top = min(max(top_counts), vocab)
    return _finish(raw, token_ids, samplable, top_counts, max_top, emitted=emitted)


def _expand(row: SamplingRow, draft: list[int]) -> list[SamplingRow]:
    """`row` at each position `j = 0 .. len(draft)`, as if `draft[:j]` were in its output.

    Only penalties read the tokens themselves; for other rows position `j` counts the drafts
    as `pending` (step = row.step + j for min_tokens and the seeded counter) and shares the
    output list, so expanding costs no copy of the output."""
    positions = range(len(draft) + 1)
    if row.grammar is None and not row.params.uses_penalties:
        return [replace(row, pending=row.pending + j) for j in positions]
    # Penalties and the grammar mask read the drafts before position j (a grammar row's
    # matcher is synced to each position's tokens in order, its own `grammar_committed`).
    output = list(row.output_token_ids)
    committed = len(output) if row.grammar is not None else None
    return [
        replace(row, output_token_ids=output + draft[:j], grammar_committed=committed)
        for j in positions
    ]


def _verify_greedy(
    sampler: Sampler, x: Tensor, draft_ids: Tensor, drafted: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """`(token_ids, accepted, samplable)` of greedy positions: the processed argmax, and
    whether the position's draft equals it."""
    token_ids, samplable = _greedy(x, sampler._ops)
    accepted = drafted & samplable & greedy_accepts(token_ids, draft_ids)
    return token_ids, accepted, samplable


def _verify_plain_greedy(
    sampler: Sampler, logits: Tensor, drafts: Sequence[Sequence[int]]
) -> SampledBatch:
    """Every row greedy with nothing processing its logits and no alternatives asked for
    (`sample`'s one-kernel case, per position): one `greedy_logprobs` launch gives each
    position's token (the raw argmax), its logprob, rank and samplable flag, already packed;
    the drafts are accepted where they equal it. Same tokens as the general path."""
    assert sampler._ops is not None
    vocab = logits.shape[1]
    draft_at: list[int] = []
    starts: list[int] = []
    for i, draft in enumerate(drafts):
        tokens = [int(t) for t in draft]
        if any(t < 0 or t >= vocab for t in tokens):
            raise MetraleError(f"verify got a draft token outside [0, {vocab}) in row {i}")
        starts.extend([len(draft_at)] * (len(tokens) + 1))
        draft_at.extend(tokens)
        draft_at.append(-1)  # the bonus position: never accepted
    device = logits.device
    token_ids, packed = sampler._ops.greedy_logprobs(logits)
    draft_ids = to_device(draft_at, torch.int64, device)
    samplable = packed[:, 3] > 0
    accepted = (draft_ids >= 0) & samplable & greedy_accepts(token_ids, draft_ids)
    emitted = _emitted(accepted, to_device(starts, torch.int64, device))
    return SampledBatch.from_kernel(token_ids, packed, samplable=samplable, emitted=emitted)


def _emitted(accepted: Tensor, row_starts: Tensor) -> Tensor:
    """A position is emitted iff no position of its row before it was rejected (bonus
    positions count as rejected: they end their row). `row_starts`: per position, the first
    position of its row."""
    rejected = (~accepted).to(torch.int64)
    before = rejected.cumsum(0) - rejected
    return before == before.index_select(0, row_starts)


def greedy_accepts(token_ids: Tensor, draft_ids: Tensor) -> Tensor:
    """Greedy acceptance: a draft is accepted iff it is the target's (processed) argmax. Its
    own function so `metrale bench spec-cost` can force an acceptance rate on a model whose
    drafts it cannot predict (dummy weights), keeping every other part of the step."""
    return token_ids == draft_ids


def _verify_sampled(
    sampler: Sampler,
    x: Tensor,
    rows: Sequence[SamplingRow],
    has_draft: Sequence[bool],
    draft_ids: Tensor,
    drafted: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """`(token_ids, accepted, samplable)` of sampled positions (expanded rows, in order):
    the rejection-sampling test at draft positions, the residual or bonus draw otherwise."""
    device = x.device
    probs, samplable = _probabilities(x, rows)
    accept_uniforms, draw_uniforms = _uniforms(sampler, rows, has_draft)
    accepted = drafted & samplable
    accepted = accepted & accept_drafts(
        probs, draft_ids, to_device(accept_uniforms, torch.float64, device)
    )
    # The residual max(p - onehot(d), 0) renormalised is p with d zeroed; bonus rows keep p.
    p_draft = probs.gather(1, draft_ids.unsqueeze(1))
    residual = probs.scatter(
        1, draft_ids.unsqueeze(1), torch.where(drafted.unsqueeze(1), 0.0, p_draft)
    )
    drawn = _inverse_cdf(residual, to_device(draw_uniforms, torch.float64, device))
    # p(d) = 1 leaves an empty residual, but then u < p(d) always accepted; keep d regardless.
    drawn = torch.where(residual.sum(dim=-1) > 0, drawn, draft_ids)
    token_ids = torch.where(accepted, draft_ids, drawn)
    return token_ids, accepted, samplable


def _uniforms(
    sampler: Sampler, rows: Sequence[SamplingRow], has_draft: Sequence[bool]
) -> tuple[list[float], list[float]]:
    """Per expanded row (position), its acceptance uniform (0.5, unused, at a bonus position)
    and its draw uniform; see the module's invariants for the seeded and unseeded streams."""
    accept: list[float] = []
    draw: list[float] = []
    for row, drafted in zip(rows, has_draft):
        if drafted:
            seed = row.effective_seed
            if seed is None:
                accept.append(sampler._uniform(row))
            else:
                accept.append(row_uniform(mix_seed(seed, ACCEPT_SALT), row.step))
        else:
            accept.append(0.5)
        draw.append(sampler._uniform(row))  # row_uniform(seed, step) when seeded
    return accept, draw
