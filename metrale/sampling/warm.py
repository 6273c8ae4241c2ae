"""Compile the sampler's device kernels before the first request needs them.

Owner: sampling. `warm_sampler` is called once by the engine; it does nothing off CUDA (the
CPU path compiles nothing).
Why: the decode graphs hold the forward, not the sampler, so without it the first sampled
request paid the Triton compilation of every sampled path (its TTFT was 2.96 s against
0.05 s on the H200 in the first sampled ladder of `tools/gpu_session.sh serve SAMPLED=1`).

Invariants:
- The rows are seeded, so no unseeded uniform is drawn (the sampler's random stream is as
  if the warm-up never ran), and the sampler's path counters are restored afterwards, so
  metrics count only real batches.
- Paths: greedy, the candidate draw at the two common widths (top-k <= 32 and <= 64) with
  each combination of top-p and min-p, and the full-row paths (top-p, top-p with min-p,
  temperature alone), each at 1 and `rows` rows.
"""

from __future__ import annotations

import logging
import time

import torch

from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)

#: The settings each warm-up batch takes: every specialisation the sampled paths compile for
#: the common chat-client settings (the candidate kernel's width 64 / 128 with and without
#: top-p and min-p, the full-row kernel's filters). The first ladder of the H200 run missed
#: (top-k 50, top-p 0.95, no min-p) and its first request still paid 0.8 s of compilation.
_SETTINGS = (
    SamplingParams(temperature=0.0),
    *(
        SamplingParams(seed=1, temperature=0.8, top_k=k, top_p=p, min_p=m)
        for k in (20, 50)
        for p in (1.0, 0.95)
        for m in (0.0, 0.05)
    ),
    SamplingParams(seed=3, temperature=0.7, top_p=0.9),
    SamplingParams(seed=4, temperature=0.7, top_p=0.9, min_p=0.05),
    SamplingParams(seed=5, temperature=0.7),
)


def warm_sampler(sampler: Sampler, vocab: int, device: str, rows: int = 8) -> float:
    """Run `warm_batches` on `device` (a torch device name) when it is CUDA; returns the
    seconds (0 and nothing run elsewhere)."""
    if not device.startswith("cuda"):
        return 0.0
    start = time.perf_counter()
    warm_batches(sampler, vocab, device, rows)
    seconds = time.perf_counter() - start
    logger.info("sampler kernels compiled in %.1fs (%d settings at 1 and %d rows)",
                seconds, len(_SETTINGS), rows)  # fmt: skip
    return seconds


def warm_batches(sampler: Sampler, vocab: int, device: str, rows: int) -> None:
    """One batch per setting of `_SETTINGS` at 1 and `rows` rows, read back; the sampler's
    counters are left as they were and no unseeded uniform is drawn."""
    counters = dict(sampler.stats)
    gen = torch.Generator(device=device).manual_seed(0)
    for n in sorted({1, rows}):
        logits = torch.randn(n, vocab, generator=gen, device=device) * 2.5
        for params in _SETTINGS:
            sampler.sample(logits, [SamplingRow(params=params) for _ in range(n)]).to_host()
    sampler.stats.clear()
    sampler.stats.update(counters)
