"""The sampler's results: `SampledBatch` on the device, `SamplerOutput` on the host, and the one
copy between them.

Owner: sampling (produced by `Sampler.sample` and `Sampler.verify`, read back by the engine).

Invariants:
- Every row's token id, raw logprob, rank, samplable flag, top alternatives and (verify only)
  emitted flag travel back in one packed float64 tensor (ids and ranks are < 2**53, so
  float64 carries them exactly). Packed columns: id, logprob, rank, samplable, K top ids,
  K top logprobs, then `emitted` when the batch has it, then `rerouted` when it has that.
- `SampledBatch.start_copy()` queues that copy into pinned memory and records an event; work
  queued on the stream afterwards never delays `to_host()`, which waits for the event only.
  Without a CUDA device the copy is immediate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplerOutput:
    """Host-side result of one sampler call; lists are indexed like the logits rows."""

    token_ids: list[int]
    #: Raw logprob of the chosen token.
    logprobs: list[float]
    #: 1-based rank of the chosen token under the raw logits.
    ranks: list[int]
    #: Per row, best first, `params.logprobs` (token id, raw logprob) pairs; an empty list for
    #: rows that asked for none. None when no row of the batch asked for alternatives.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: Rows that had no samplable token; their token is a fallback (see the module docstring).
    unsamplable_rows: list[int] = field(default_factory=list)
    #: `Sampler.verify` only: per logits row (position), whether the target emits its token
    #: (each sequence's accepted drafts and the one token after them). None from `sample`.
    emitted: list[bool] | None = None
    #: Rows of a candidate draw (`metrale.sampling.candidates`) that the full-row draw took
    #: instead (a NaN logit, or more ties at the k-th largest logit than the candidates).
    rerouted_rows: list[int] = field(default_factory=list)


@dataclass
class SampledBatch:
    """Device-side result of `Sampler.sample` / `Sampler.verify`; `to_host()` copies it back in
    one transfer."""

    token_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] float32
    ranks: Tensor  # [B] int64
    samplable: Tensor  # [B] bool
    top_token_ids: Tensor | None  # [B, K] int64, K = the batch's largest params.logprobs
    top_logprobs: Tensor | None  # [B, K] float32
    #: Per row, how many of the K alternatives it asked for.
    top_counts: list[int]
    #: `Sampler.verify` only: `[B]` bool, whether the position's token is emitted; None from
    #: `sample`.
    emitted: Tensor | None = None
    #: The results already packed on the device (`[B, 4 + 2K]` float64, then the
    #: `emitted` / `rerouted` columns the batch has), when one kernel produced them
    #: (`KernelOps.greedy_logprobs`, `token_logprobs`); else packed from the fields above.
    packed: Tensor | None = None
    #: Candidate draw only: `[B]` bool, the rows the full-row draw took (packed last).
    rerouted: Tensor | None = None
    #: Told how many rows were re-routed when the result is read back (the sampler's counter).
    on_rerouted: Callable[[int], None] | None = None
    #: The packed host copy started by `start_copy` and the event that marks it done.
    _host: Tensor | None = None
    _copied: torch.cuda.Event | None = None

    @classmethod
    def from_kernel(
        cls,
        token_ids: Tensor,
        packed: Tensor,
        *,
        samplable: Tensor | None = None,
        emitted: Tensor | None = None,
        rerouted: Tensor | None = None,
    ) -> SampledBatch:
        """A batch without top alternatives whose first four columns one kernel packed
        (`KernelOps.greedy_logprobs`, `token_logprobs`: `[B, 4]` float64); `emitted` and
        `rerouted`, when given, are appended to them in the packed order. `samplable`: the
        device-side flag when the caller already derived it (else the packed column)."""
        extra = [c.unsqueeze(1).to(packed.dtype) for c in (emitted, rerouted) if c is not None]
        if extra:
            packed = torch.cat([packed, *extra], dim=1)
        return cls(
            token_ids=token_ids,
            logprobs=packed[:, 1],
            ranks=packed[:, 2],
            samplable=packed[:, 3] if samplable is None else samplable,
            top_token_ids=None,
            top_logprobs=None,
            top_counts=[0] * packed.shape[0],
            emitted=emitted,
            packed=packed,
            rerouted=rerouted,
        )

    def _packed(self) -> Tensor:
        if self.packed is not None:  # the greedy kernel paths (verify's with its emitted column)
            return self.packed
        columns = [
            self.token_ids.unsqueeze(1),
            self.logprobs.unsqueeze(1),
            self.ranks.unsqueeze(1),
            self.samplable.unsqueeze(1),
        ]
        if self.top_token_ids is not None and self.top_logprobs is not None:
            columns += [self.top_token_ids, self.top_logprobs]
        if self.emitted is not None:
            columns.append(self.emitted.unsqueeze(1))
        if self.rerouted is not None:
            columns.append(self.rerouted.unsqueeze(1))
        # Token ids and ranks are < 2**53, so float64 carries them exactly: one copy.
        return torch.cat([c.to(torch.float64) for c in columns], dim=1)

    def start_copy(self) -> None:
        """Queue the device-to-host copy of the results now (pinned, non-blocking), so work
        queued on the stream after this call does not delay `to_host`. No sync."""
        if self._host is not None:
            return
        packed = self._packed()
        if packed.device.type != "cuda":
            self._host = packed
            return
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._host, self._copied = host, event

    def to_host(self) -> SamplerOutput:
        """The results on the host: waits for the copy (started here if `start_copy` was
        not called); the step's one synchronisation."""
        self.start_copy()
        assert self._host is not None
        if self._copied is not None:
            self._copied.synchronize()
        packed = self._host.tolist()
        width = 0 if self.top_token_ids is None else self.top_token_ids.shape[1]
        token_ids: list[int] = []
        logprobs: list[float] = []
        ranks: list[int] = []
        unsamplable: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        emitted: list[bool] | None = None if self.emitted is None else []
        rerouted: list[int] = []
        rerouted_column = 4 + 2 * width + (self.emitted is not None)
        for i, values in enumerate(packed):
            token_ids.append(int(values[0]))
            logprobs.append(values[1])
            ranks.append(int(values[2]))
            if not values[3]:
                unsamplable.append(i)
            if width:
                count = self.top_counts[i]
                ids = values[4 : 4 + count]
                lps = values[4 + width : 4 + width + count]
                tops.append([(int(t), lp) for t, lp in zip(ids, lps)])
            if emitted is not None:
                emitted.append(bool(values[4 + 2 * width]))
            if self.rerouted is not None and values[rerouted_column]:
                rerouted.append(i)
        if self.on_rerouted is not None and rerouted:
            self.on_rerouted(len(rerouted))
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            ranks=ranks,
            top_logprobs=tops if width else None,
            unsamplable_rows=unsamplable,
            emitted=emitted,
            rerouted_rows=rerouted,
        )
