"""Stage 1 of the sampler's pipeline, and the host-to-device helpers its stages share.

Owner: sampling. `process_logits` is what `Sampler.sample` and `Sampler.verify` (through
`metrale.sampling.verify`) run first on every row, greedy or not: the repetition penalty
(prompt + output tokens), then frequency/presence penalties (output tokens, plus a fed row's
pending token read on the device), then logit_bias, then min_tokens masking (the ids of
`SamplingParams.masked_stop_token_ids` at -inf while `SamplingParams.stop_tokens_allowed` is
False for the row's step) and bad words (`SamplingParams.banned_tokens`), then
`allowed_token_ids` (every other logit at -inf), then the grammar mask of rows with a
`grammar` (structured output: `metrale.sampling.grammar_mask.apply_grammar_masks`, a bitmask filled
on the host and applied on the device). The tensor ops themselves are `logits_processors`'.

Invariants:
- The input logits are never written: every stage is out of place.
- No host<->device synchronisation: `to_device` moves host data (parameters, token ids)
  through pinned memory, non-blocking; nothing reads a device value back.
- Token ids outside `[0, vocab)` (logit_bias keys, stop ids) are ignored here rather than
  failing the batch (`SamplingParams.validate_for_vocab` rejects them at admission).
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from metrale.errors import MetraleError
from metrale.sampling.logits_processors import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
    mask_tokens,
    token_counts,
)

if TYPE_CHECKING:
    from metrale.kernels import KernelOps
    from metrale.sampling.sampler import SamplingRow

__all__ = ["apply_to_rows", "process_logits", "to_device"]


def process_logits(
    x: Tensor,
    rows: Sequence[SamplingRow],
    pending_tokens: Tensor | None,
    ops: KernelOps | None = None,
) -> Tensor:
    """Stage 1 for every row of `x` (`[B, V]` float32, one row per entry of `rows`): penalties,
    logit bias and min_tokens masks, out of place. `pending_tokens` as in `Sampler.sample`;
    `ops`: the op set the grammar mask goes through (None: the torch reference)."""
    vocab = x.shape[1]
    device = x.device
    penalised = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if penalised:
        pending = None
        if any(rows[i].pending for i in penalised):
            if pending_tokens is None:
                raise MetraleError(
                    "a row with penalties and a pending token needs `pending_tokens`"
                )
            pending = pending_tokens
            if len(penalised) < len(rows):
                pending = pending.index_select(0, to_device(penalised, torch.int64, device))
        x = apply_to_rows(
            x,
            penalised,
            lambda sub: _apply_penalties(sub, [rows[i] for i in penalised], pending),
        )

    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if params.logit_bias:
            for token, bias in params.logit_bias.items():
                if 0 <= token < vocab:
                    bias_rows.append(i)
                    bias_tokens.append(token)
                    bias_values.append(bias)
        masked: set[int] = set()
        if not params.stop_tokens_allowed(row.step):
            masked.update(params.masked_stop_token_ids(row.eos_token_ids))
        if params.bad_words_token_ids:
            masked.update(params.banned_tokens(row.output_token_ids))
        for token in sorted(masked):
            if 0 <= token < vocab:
                mask_rows.append(i)
                mask_ids.append(token)
    if bias_rows:
        x = apply_logit_bias(
            x,
            to_device(bias_rows, torch.int64, device),
            to_device(bias_tokens, torch.int64, device),
            to_device(bias_values, torch.float32, device),
        )
    if mask_rows:
        x = mask_tokens(
            x,
            to_device(mask_rows, torch.int64, device),
            to_device(mask_ids, torch.int64, device),
        )
    allowed = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if allowed:
        x = apply_to_rows(x, allowed, lambda sub: _keep_only(sub, [rows[i] for i in allowed]))
    grammar_rows = [i for i, row in enumerate(rows) if row.grammar is not None]
    if grammar_rows:
        from metrale.sampling.grammar_mask import apply_grammar_masks

        if any(rows[i].pending for i in grammar_rows):
            raise MetraleError("a grammar row cannot have a pending token (it is never fed)")
        x = apply_grammar_masks(
            x,
            grammar_rows,
            [rows[i].grammar for i in grammar_rows],  # type: ignore[misc]
            [rows[i].output_token_ids for i in grammar_rows],
            [rows[i].grammar_committed for i in grammar_rows],
            ops,
        )
    return x


def _keep_only(x: Tensor, rows: Sequence[SamplingRow]) -> Tensor:
    """Every logit of `x` at -inf except each row's `allowed_token_ids` (vLLM's field)."""
    vocab = x.shape[1]
    keep = torch.zeros(x.shape, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids = [t for t in row.params.allowed_token_ids or () if 0 <= t < vocab]
        keep[i, ids] = True
    if x.device.type == "cuda":
        keep = keep.pin_memory().to(x.device, non_blocking=True)
    return x.masked_fill(~keep, float("-inf"))


def to_device(
    values: Sequence[int] | Sequence[float] | Tensor, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Host values (a list or a CPU tensor) on `device` without a sync (pinned, non-blocking)."""
    if isinstance(values, Tensor):
        host = values.to(dtype)
        if device.type == "cuda":
            host = host.pin_memory()
    elif device.type == "cuda":
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    else:
        return torch.tensor(values, dtype=dtype, device=device)
    return host.to(device, non_blocking=True)


def apply_to_rows(x: Tensor, rows: Sequence[int], fn: Callable[[Tensor], Tensor]) -> Tensor:
    """`fn` applied to the rows `rows` (sorted, unique) of `x`; other rows unchanged."""
    if len(rows) == x.shape[0]:
        return fn(x)
    index = to_device(list(rows), torch.int64, x.device)
    return x.index_copy(0, index, fn(x.index_select(0, index)))


def _flatten_ids(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """`(row_ids, token_ids)`: every token of every sequence, flat, as device tensors."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    row_ids = torch.repeat_interleave(torch.arange(len(sequences), dtype=torch.int64), lengths)
    buffer = array.array("q")
    for sequence in sequences:
        if isinstance(sequence, list):
            buffer.fromlist(sequence)  # the fast path: C-level copy of a list of ints
        else:
            buffer.extend(sequence)
    if buffer:
        token_ids = torch.frombuffer(buffer, dtype=torch.int64)
    else:
        token_ids = torch.empty(0, dtype=torch.int64)
    return to_device(row_ids, torch.int64, device), to_device(token_ids, torch.int64, device)


def _apply_penalties(
    x: Tensor, rows: Sequence[SamplingRow], pending: Tensor | None = None
) -> Tensor:
    """Repetition then frequency/presence penalties on `x` (one row per entry of `rows`);
    `pending` (`[len(rows)]`, on the device) adds one output token per row whose `pending`
    is set (a fed row's token that the host has not read yet)."""
    count, vocab = x.shape
    device = x.device
    row_ids, token_ids = _flatten_ids([row.output_token_ids for row in rows], device)
    if pending is not None:
        fed = [i for i, row in enumerate(rows) if row.pending]
        fed_index = to_device(fed, torch.int64, device)
        row_ids = torch.cat([row_ids, fed_index])
        token_ids = torch.cat([token_ids, pending.index_select(0, fed_index)])
    output_counts = token_counts(row_ids, token_ids, count, vocab, x.dtype)

    repetition = [row.params.repetition_penalty for row in rows]
    if any(p != 1.0 for p in repetition):
        prompts = [
            row.prompt_token_ids if row.params.repetition_penalty != 1.0 else () for row in rows
        ]
        prompt_rows, prompt_tokens = _flatten_ids(prompts, device)
        prompt_counts = token_counts(prompt_rows, prompt_tokens, count, vocab, x.dtype)
        seen = (output_counts > 0) | (prompt_counts > 0)
        x = apply_repetition_penalty(x, seen, to_device(repetition, torch.float32, device))

    frequency = [row.params.frequency_penalty for row in rows]
    presence = [row.params.presence_penalty for row in rows]
    if any(frequency) or any(presence):
        x = apply_frequency_presence(
            x,
            output_counts,
            to_device(frequency, torch.float32, device),
            to_device(presence, torch.float32, device),
        )
    return x
