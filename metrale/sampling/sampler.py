"""The batched sampler: one token per logits row, with its logprob, rank and top alternatives.

Owner: sampling. The engine hands the sampler the model's logits `[B, V]` and one
`SamplingRow` per logits row; the sampler returns the chosen token ids and their logprobs
(`metrale.sampling.result`: on the device, and the one copy back). Stage 1 below lives in
`metrale.sampling.processing` (`process_logits`, with its host-to-device helpers), the filters
in `logits_processors`, the later stages as functions over a batch in `metrale.sampling.draw`.

Pipeline, per row (each stage is one batched tensor op over the rows that need it):
1. repetition penalty (prompt + output tokens), then frequency/presence penalties (output
   tokens), then logit_bias, then min_tokens masking (EOS and stop_token_ids at -inf while
   fewer than `min_tokens` tokens were generated: `SamplingParams.stop_tokens_allowed`, the
   rule the scheduler stops by), then the grammar mask of structured-output rows (every
   token the row's grammar forbids at -inf, `metrale.sampling.grammar`) — for greedy rows
   too (`processing.process_logits`), so a greedy grammar row is a masked argmax;
2. greedy rows (temperature < 1e-5): argmax of the processed logits (ties: lowest id);
3. other rows: divide by temperature, top-k (every logit >= the k-th largest stays, ties
   included), softmax, min-p, top-p (a token stays while the float64 mass ranked above it,
   by descending probability with ties ranked by token id, is < top_p * the row's mass), then
   an inverse-CDF draw: one uniform `u` in (0, 1) per row, the token is the first whose
   float64 cumulative probability (in token-id order) reaches `u * total`, i.e. token i with
   probability `probs[i] / sum(probs)`; a token whose probability is 0 can never be chosen.
   This is `metrale.kernels.reference.top_k_top_p_sample`'s definition, stage for stage.

`Sampler.verify` (`metrale.sampling.verify`) scores drafts on the same distributions (stage 1
and `draw.probabilities`, shared with `_draw`), one logits row per draft position.

Candidate draw: a batch with sampled rows whose every sampled row has a top-k of 1..
`candidates.K_MAX` (greedy rows ride along) draws each row on its largest logits only
(`metrale.sampling.candidates`: `torch.topk`, then stage 3 on `[B, width]` in one
`ops.candidate_sample` launch), the same function stage for stage. A row whose k-th largest
logit ties past its candidates, or that holds a NaN, is re-routed to the full-row draw (on
CUDA `ops.top_k_top_p_sample` with `active=` those rows and `temperature=`: one launch that
skips the other rows, no sync; on the CPU the torch path on those rows). With `ops`, the raw
logprob and rank then come from one `ops.token_logprobs` pass. `Sampler.stats` counts the
batches by path, the re-routed rows (also listed in `SamplerOutput.rerouted_rows`) and, by
reason, the sampled batches the candidate draw could not take (each reason also logged
once). `candidate_k_max=None` turns it off.

Kernels: given `ops` (a `KernelOps`; the engine passes the model's, Triton on CUDA), a batch
of greedy rows that nothing processes and that want no alternatives takes one
`ops.greedy_logprobs` launch for the whole result (its logsumexp sums in another order than
torch's); a batch of greedy rows that only min_tokens' stop-id mask processes (plain rows
beside them) and that want no alternatives takes `ops.stop_masked_greedy` where the ops have
it (the CPU's C kernel: the torch path's values bit for bit, in a few calls); otherwise
greedy rows take `ops.argmax`. Of the batches the candidate draw does not
take, one of at least `KERNEL_MIN_ROWS` non-greedy rows that the torch path would fully sort
(a top-p row without top-k) takes `ops.top_k_top_p_sample` (no vocabulary sort) after the
temperature; other batches keep the torch path, which measured faster for them on the H200 (see `KERNEL_MIN_ROWS`). Both paths
compute the function above, so which one a batch took does not change a seeded row's token
(up to the floating-point reductions noted below: the kernel sums in another order). One known difference: `ops.argmax` ranks a +inf logit above a float32-max
one, where the torch path reads +inf as the float32 max (then ties go to the lowest id); the
two differ only for a row holding both values.

Invariants:
- Logprobs, ranks and top alternatives describe the model's RAW distribution:
  `log_softmax(logits.float())` before any penalty, bias, mask, temperature or filter
  (vLLM's default "raw_logprobs"), so they compare directly with transformers' logits.
  The rank is 1 + the number of tokens with a strictly larger raw logit.
- A seeded row's draw depends only on (its seed, `len(output_token_ids)`, its own logits): its
  uniform is `row_uniform(seed, step)`, a pure-Python SplitMix64 function of both, so a seeded
  request repeats exactly across runs, batch sizes, batch positions, neighbours and device
  types (CPU and CUDA draw the same token), and continues reproducibly after preemption.
  ("Exactly" up to floating-point reductions of softmax/cumsum, which do not depend on the
  batch in practice.) Unseeded rows take their uniforms from one host `random.Random` owned
  by the `Sampler` (seeded from its constructor's seed, else from OS entropy).
- A row with no samplable token (every processed logit -inf or NaN, e.g. a model that produced
  NaN, or masks that remove every token) never fails the batch: its token falls back to the
  argmax of its raw logits (NaN read as -inf; token 0 if none is finite) and its index is
  reported in `SamplerOutput.unsamplable_rows`, for the engine to end that request with an
  error. Other NaN / +inf logits are read as -inf / the largest float.
- The caller's logits tensor is never written.
- `sample()` issues no host<->device synchronisation: host data (parameters, token ids) goes
  to the device through pinned memory, non-blocking. `SampledBatch.start_copy()` queues the
  one copy back (a packed tensor into pinned memory, marked by an event), so later work on
  the stream does not delay it; `SampledBatch.to_host()` waits for that event only.
- A `Sampler` is used by one thread (the engine loop); it is not thread-safe.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from metrale.errors import MetraleError
from metrale.sampling import candidates
from metrale.sampling.candidates import inverse_cdf as _inverse_cdf
from metrale.sampling.draw import NEG_INF, gather_logprobs
from metrale.sampling.draw import filter_rows as _filter
from metrale.sampling.draw import finish as _finish
from metrale.sampling.draw import grammar_greedy as _grammar_greedy
from metrale.sampling.draw import greedy as _greedy
from metrale.sampling.draw import plain_greedy as _plain_greedy
from metrale.sampling.draw import stop_mask as _stop_mask
from metrale.sampling.draw import stop_masked_greedy as _stop_masked_greedy
from metrale.sampling.draw import temper as _temper
from metrale.sampling.params import SamplingParams, mix_seed, row_uniform, uniform_from_bits
from metrale.sampling.processing import process_logits, to_device
from metrale.sampling.result import SampledBatch, SamplerOutput

if TYPE_CHECKING:
    from metrale.kernels import KernelOps
    from metrale.sampling.grammar import GrammarState

__all__ = [
    "SampledBatch",
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "gather_logprobs",
    "row_uniform",
]

logger = logging.getLogger(__name__)

#: Fewest non-greedy rows for which `Sampler` calls `ops.top_k_top_p_sample` rather than the
#: torch path, by default only for a batch the torch path would fully sort (a top-p row
#: without top-k). Measured on the H200 (`tools/bench_sampler.py`, vocabulary 152k, whole
#: `sample()` calls; bench/records/20261129T230000-sampler-qwen3-vocab.json): with top-p 0.95
#: alone the split-row kernel takes 0.96 / 1.08 / 1.69 / 3.15 ms at 16 / 32 / 64 / 128 rows
#: against torch's 1.21 / 1.60 / 2.26 / 4.30, and loses at 8 rows and fewer (1.09 vs 1.00);
#: with top-k 50 as well torch sorts only the k candidates and wins from 64 rows on, and
#: temperature alone is 5-40% faster on torch at every batch.
KERNEL_MIN_ROWS: int | None = 16


@dataclass
class SamplingRow:
    """What the sampler needs to know about the sequence behind one logits row."""

    params: SamplingParams
    #: Tokens generated so far (frequency/presence penalties, min_tokens, the seeded step).
    output_token_ids: Sequence[int] = ()
    #: The prompt; the repetition penalty looks at prompt + output (as HF and vLLM do).
    prompt_token_ids: Sequence[int] = ()
    #: The effective seed of this row (the engine derives it per choice with
    #: `derive_choice_seed`); None falls back to `params.seed`, None there too: unseeded.
    seed: int | None = None
    #: The model's EOS ids: masked, with `params.stop_token_ids`, until min_tokens is reached
    #: (whatever `ignore_eos` says: that only decides whether EOS finishes the sequence).
    eos_token_ids: frozenset[int] = frozenset()
    #: Tokens sampled for this sequence but not yet in `output_token_ids` (0, or 1 for a row
    #: of a step launched on the device token feed before the previous step was read back).
    #: They count for the seeded draw's counter and for min_tokens; penalties read the token
    #: itself from `Sampler.sample`'s `pending_tokens` (on the device).
    pending: int = 0
    #: The sequence's grammar matcher (structured output; `metrale.sampling.grammar`), synced
    #: to `output_token_ids` and applied last in stage 1. Such a row is never fed (`pending`
    #: is 0).
    grammar: GrammarState | None = None
    #: On a verify position of a grammar row: how many of `output_token_ids` are the
    #: sequence's own (the rest are drafts); None otherwise.
    grammar_committed: int | None = None

    @property
    def effective_seed(self) -> int | None:
        return self.seed if self.seed is not None else self.params.seed

    @property
    def step(self) -> int:
        """Index of the token being sampled within the output (the seeded draw's counter)."""
        return len(self.output_token_ids) + self.pending


class Sampler:
    """Samples one token per logits row; see the module docstring for the pipeline."""

    def __init__(
        self,
        seed: int | None = None,
        ops: KernelOps | None = None,
        kernel_min_rows: int | None = KERNEL_MIN_ROWS,
        kernel_for_full_sort_only: bool = True,
        candidate_k_max: int | None = candidates.K_MAX,
    ) -> None:
        #: Source of unseeded rows' uniforms; None seeds it from OS entropy.
        self._rng = random.Random(None if seed is None else mix_seed(seed))
        #: The device's sampling ops (`argmax`, `top_k_top_p_sample`); None: torch path only.
        self._ops = ops
        #: Fewest non-greedy rows that take `ops.top_k_top_p_sample`; None: never (see
        #: `KERNEL_MIN_ROWS`).
        self._kernel_min_rows = kernel_min_rows
        #: Whether the kernel takes only batches the torch path would fully sort (False:
        #: every batch of `kernel_min_rows` or more; tests and the benchmark).
        self._kernel_for_full_sort_only = kernel_for_full_sort_only
        #: Largest top-k a batch's rows may have to take the candidate draw
        #: (`metrale.sampling.candidates`); None: never (tests and the benchmark).
        if candidate_k_max is not None and not 1 <= candidate_k_max <= candidates.K_MAX:
            raise MetraleError(
                f"candidate_k_max must lie in 1..{candidates.K_MAX} (or be None), "
                f"got {candidate_k_max}"
            )
        self._candidate_k_max = candidate_k_max
        #: Batches by the path they took ("greedy_kernel", "stop_masked_greedy_kernel",
        #: "grammar_greedy_kernel", "candidates", "kernel", "torch"),
        #: "candidate_rerouted_rows" (rows of candidate draws that the full-row draw took,
        #: counted when read back), and "full_row:<reason>" (batches with a sampled row that
        #: the candidate draw could not take). Read by metrics and the benchmark.
        self.stats: dict[str, int] = {}
        #: Reasons already logged (each once per sampler).
        self._logged: set[str] = set()

    def __call__(self, logits: Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sample(logits, rows).to_host()

    # ---------------------------------------------------------------------------------------
    # Sampling
    # ---------------------------------------------------------------------------------------

    def sample(
        self,
        logits: Tensor,
        rows: Sequence[SamplingRow],
        pending_tokens: Tensor | None = None,
    ) -> SampledBatch:
        """Sample every row without synchronising with the device. `pending_tokens` (`[B]`
        int64 on the device): each row's token not yet in `output_token_ids` (rows with
        `pending`, i.e. fed steps); penalties count it. Required when such a row has one."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise MetraleError(
                f"sampler got logits of shape {tuple(logits.shape)} for {len(rows)} rows"
            )
        batch, vocab = logits.shape
        device = logits.device
        top_counts = [row.params.logprobs or 0 for row in rows]
        max_top = min(max(top_counts, default=0), vocab)
        if batch == 0:
            empty_long = torch.empty(0, dtype=torch.int64, device=device)
            return SampledBatch(
                token_ids=empty_long,
                logprobs=torch.empty(0, dtype=torch.float32, device=device),
                ranks=empty_long,
                samplable=torch.empty(0, dtype=torch.bool, device=device),
                top_token_ids=None,
                top_logprobs=None,
                top_counts=[],
            )

        if self._ops is not None and max_top == 0 and all(map(_plain_greedy, rows)):
            # The decode common case: one kernel gives the token, its raw logprob, its rank
            # (1: nothing beats the argmax of unprocessed logits) and samplable, packed.
            token_ids, packed = self._ops.greedy_logprobs(logits)
            self._count("greedy_kernel")
            return SampledBatch.from_kernel(token_ids, packed)
        stop_masked = None if self._ops is None else self._ops.stop_masked_greedy
        if stop_masked is not None and max_top == 0 and all(map(_stop_masked_greedy, rows)):
            # Greedy rows that only min_tokens' stop-id mask changes (and plain ones beside
            # them): the torch path's values, bit for bit, in one pass but its logsumexp.
            token_ids, packed = stop_masked(logits, [_stop_mask(row, vocab) for row in rows])
            self._count("stop_masked_greedy_kernel")
            return SampledBatch.from_kernel(token_ids, packed)
        if self._ops is not None and max_top == 0 and all(map(_grammar_greedy, rows)):
            # Greedy rows under a grammar: the argmax over the bitmask's allowed tokens, read
            # beside the logits (no masked copy), then the token's raw logprob and rank.
            from metrale.sampling.grammar_mask import grammar_bitmask

            grammars = [row.grammar for row in rows]
            mask = grammar_bitmask(
                device, vocab, grammars, [row.output_token_ids for row in rows]  # type: ignore[arg-type]
            )  # fmt: skip
            token_ids, values = self._ops.masked_argmax(logits, mask)
            token_ids, packed = self._ops.token_logprobs(logits, token_ids, values > NEG_INF)
            self._count("grammar_greedy_kernel")
            return SampledBatch.from_kernel(token_ids, packed)
        raw = logits.float()  # may alias the caller's tensor: only out-of-place ops below
        x = process_logits(raw, rows, pending_tokens, self._ops)

        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if sampled:
            route = self._candidate_route(rows, vocab, device)
            if route is not None:
                return self._sample_candidates(raw, x, rows, route, top_counts, max_top)
        if not sampled:
            token_ids, samplable = _greedy(x, self._ops)
        elif not greedy:
            token_ids, samplable = self._draw(x, rows)
        else:
            token_ids = torch.empty(batch, dtype=torch.int64, device=device)
            samplable = torch.empty(batch, dtype=torch.bool, device=device)
            greedy_index = to_device(greedy, torch.int64, device)
            sampled_index = to_device(sampled, torch.int64, device)
            greedy_ids, greedy_ok = _greedy(x.index_select(0, greedy_index), self._ops)
            drawn_ids, drawn_ok = self._draw(
                x.index_select(0, sampled_index), [rows[i] for i in sampled]
            )
            token_ids.index_copy_(0, greedy_index, greedy_ids)
            token_ids.index_copy_(0, sampled_index, drawn_ids)
            samplable.index_copy_(0, greedy_index, greedy_ok)
            samplable.index_copy_(0, sampled_index, drawn_ok)

        return _finish(raw, token_ids, samplable, top_counts, max_top)

    def verify(
        self,
        logits: Tensor,
        rows: Sequence[SamplingRow],
        drafts: Sequence[Sequence[int]],
        pending_tokens: Tensor | None = None,
    ) -> SampledBatch:
        """Score draft tokens losslessly (`metrale.sampling.verify`): row `i` owns
        `len(drafts[i]) + 1` consecutive logits rows; the result has one entry per logits row
        and `emitted` marks the tokens the target emits. `pending_tokens` as in `sample`
        (`[len(rows)]`). No host<->device sync."""
        from metrale.sampling.verify import verify

        return verify(self, logits, rows, drafts, pending_tokens)

    def _count(self, key: str, amount: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + amount

    def _candidate_route(
        self, rows: Sequence[SamplingRow], vocab: int, device: torch.device
    ) -> str | None:
        """How a batch with sampled rows takes the candidate draw: "device" (re-routed rows
        through `ops.top_k_top_p_sample`'s full-row kernel, no sync), "host" (the CPU: the
        torch path on the re-routed rows), or None (the full-row paths; counted and logged
        once per reason)."""
        k_max = self._candidate_k_max
        if k_max is None:
            return None
        reason = None
        for row in rows:
            params = row.params
            if params.is_greedy:
                continue
            if not params.top_k_filters(vocab):
                reason = "a sampled row without a top-k"
                break
            if params.top_k > k_max:
                reason = "a top-k above the candidate bound"
                break
        route = None
        if reason is None:
            ops = self._ops
            if (
                ops is not None
                and ops.implementations.get("top_k_top_p_sample", "torch") != "torch"
            ):
                route = "device"
            elif device.type == "cpu":
                route = "host"
            else:
                reason = "no full-row kernel for re-routed rows on this device"
        if route is None:
            key = f"full_row:{reason}"
            self._count(key)
            if key not in self._logged:
                self._logged.add(key)
                logger.info("sampler: a sampled batch takes the full-row draw (%s)", reason)
        return route

    def _sample_candidates(
        self,
        raw: Tensor,
        x: Tensor,
        rows: Sequence[SamplingRow],
        route: str,
        top_counts: Sequence[int],
        max_top: int,
    ) -> SampledBatch:
        """The batch through `candidates.candidate_draw` (greedy rows ride along as its
        argmax rows), its re-routed rows through the full-row draw, then the result."""
        vocab = x.shape[1]
        params = [row.params for row in rows]
        uniforms = [
            candidates.greedy_uniform() if p.is_greedy else self._uniform(row)
            for row, p in zip(rows, params)
        ]
        sampled = [p for p in params if not p.is_greedy]
        width = candidates.candidate_width(max(p.top_k for p in sampled), vocab)
        table = candidates.pack_rows(params, uniforms, x.device)
        has_top_p = any(p.top_p_enabled for p in sampled)
        has_min_p = any(p.min_p_enabled for p in sampled)
        token_ids, samplable, rerouted = candidates.candidate_draw(
            x, table, width, has_top_p, has_min_p, self._ops
        )
        if route == "device":
            assert self._ops is not None
            full_ids, full_ok = self._ops.top_k_top_p_sample(
                x, table[1], table[2], table[4], table[3] if has_min_p else None,
                has_top_k=True, has_top_p=has_top_p, temperature=table[0], active=rerouted,
            )  # fmt: skip
            token_ids = torch.where(rerouted, full_ids, token_ids)
            samplable = torch.where(rerouted, full_ok, samplable)
        else:
            token_ids, samplable = self._reroute_on_host(
                x, rows, uniforms, rerouted, token_ids, samplable
            )
        self._count("candidates")
        if self._ops is not None and max_top == 0:
            token_ids, packed = self._ops.token_logprobs(raw, token_ids, samplable)
            batch = SampledBatch.from_kernel(token_ids, packed, rerouted=rerouted)
        else:
            batch = _finish(raw, token_ids, samplable, top_counts, max_top)
            batch.rerouted = rerouted
        batch.on_rerouted = self._count_rerouted
        return batch

    def _count_rerouted(self, rows: int) -> None:
        self._count("candidate_rerouted_rows", rows)

    def _reroute_on_host(
        self,
        x: Tensor,
        rows: Sequence[SamplingRow],
        uniforms: Sequence[float],
        rerouted: Tensor,
        token_ids: Tensor,
        samplable: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """CPU only (nothing to synchronise): the torch path's draw for the re-routed rows,
        with the uniforms they already drew."""
        index = rerouted.nonzero().flatten().tolist()
        if not index:
            return token_ids, samplable
        token_ids, samplable = token_ids.clone(), samplable.clone()
        greedy = [i for i in index if rows[i].params.is_greedy]
        if greedy:
            ids, ok = _greedy(x[greedy])
            token_ids[greedy], samplable[greedy] = ids, ok
        drawn = [i for i in index if not rows[i].params.is_greedy]
        if drawn:
            sub_rows = [rows[i] for i in drawn]
            probs, ok = _filter(_temper(x[drawn], sub_rows), sub_rows)
            u = torch.tensor([uniforms[i] for i in drawn], dtype=torch.float64)
            token_ids[drawn], samplable[drawn] = _inverse_cdf(probs, u), ok
        return token_ids, samplable

    def _draw(self, x: Tensor, rows: Sequence[SamplingRow]) -> tuple[Tensor, Tensor]:
        """Temperature, top-k, min-p, top-p and the random draw for non-greedy rows."""
        x = _temper(x, rows)
        if self._takes_kernel(rows, x.shape[1]):
            self._count("kernel")
            return self._draw_with_kernel(x, rows)
        self._count("torch")
        probs, samplable = _filter(x, rows)
        uniforms = [self._uniform(row) for row in rows]
        token_ids = _inverse_cdf(probs, to_device(uniforms, torch.float64, x.device))
        return token_ids, samplable

    def _takes_kernel(self, rows: Sequence[SamplingRow], vocab: int) -> bool:
        """Whether these non-greedy rows go to `ops.top_k_top_p_sample` (see
        `KERNEL_MIN_ROWS`): the op is a kernel (not the reference the CPU op set holds),
        enough rows, and, by default, a top-p row without top-k among them (the torch path
        would sort the whole vocabulary)."""
        min_rows = self._kernel_min_rows
        if self._ops is None or min_rows is None or len(rows) < min_rows:
            return False
        if self._ops.implementations.get("top_k_top_p_sample") == "torch":
            return False  # the op set's reference (CPU): it sorts more than the torch path
        if not self._kernel_for_full_sort_only:
            return True
        return any(row.params.top_p_enabled and not row.params.top_k_filters(vocab) for row in rows)

    def _draw_with_kernel(self, x: Tensor, rows: Sequence[SamplingRow]) -> tuple[Tensor, Tensor]:
        """`_draw` after the temperature, through `ops.top_k_top_p_sample` (same function).

        `x` is tempered and sanitized (NaN -> -inf, +inf -> float32 max, as the torch path
        reads them). Per-row parameters map one to one: top_k <= 0 or >= V, top_p >= 1 and
        min_p <= 0 mean "off" to the kernel as to `SamplingParams`. The uniforms are drawn in
        row order, as in the torch path, so unseeded rows consume the same host random stream.
        """
        assert self._ops is not None
        device = x.device
        uniforms = [self._uniform(row) for row in rows]
        min_p = None
        if any(row.params.min_p_enabled for row in rows):
            min_p = to_device([row.params.min_p for row in rows], torch.float32, device)
        vocab = x.shape[1]
        token_ids, samplable = self._ops.top_k_top_p_sample(
            x,
            to_device([row.params.top_k for row in rows], torch.int64, device),
            to_device([row.params.top_p for row in rows], torch.float32, device),
            to_device(uniforms, torch.float64, device),
            min_p,
            has_top_k=any(row.params.top_k_filters(vocab) for row in rows),
            has_top_p=any(row.params.top_p_enabled for row in rows),
        )
        return token_ids, samplable

    def _uniform(self, row: SamplingRow) -> float:
        seed = row.effective_seed
        if seed is None:
            return uniform_from_bits(self._rng.getrandbits(53))
        return row_uniform(seed, row.step)


# -------------------------------------------------------------------------------------------
# Helpers
# -------------------------------------------------------------------------------------------
