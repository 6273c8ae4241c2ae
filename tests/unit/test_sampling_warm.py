"""The sampler warm-up (`metrale.sampling.warm`): it runs every setting through the sampler,
leaves its counters as they were and draws no unseeded uniform, so the requests after it
sample as if it never ran; off CUDA `warm_sampler` runs nothing."""

from __future__ import annotations

from metrale.sampling.sampler import Sampler
from metrale.sampling.warm import _SETTINGS, warm_batches, warm_sampler


def test_warm_batches_leave_counters_and_the_random_stream_alone() -> None:
    warmed, fresh = Sampler(seed=11), Sampler(seed=11)
    warmed.stats["candidates"] = 3
    seen: list[str] = []
    real = warmed.sample

    def counting(logits, rows, pending_tokens=None):  # type: ignore[no-untyped-def]
        seen.append(str(rows[0].params.temperature))
        return real(logits, rows, pending_tokens)

    warmed.sample = counting  # type: ignore[method-assign]
    warm_batches(warmed, 300, "cpu", rows=4)
    assert len(seen) == 2 * len(_SETTINGS)
    assert warmed.stats == {"candidates": 3}
    assert warmed._rng.random() == fresh._rng.random()


def test_warm_sampler_runs_nothing_off_cuda() -> None:
    sampler = Sampler(seed=1)
    assert warm_sampler(sampler, 300, "cpu") == 0.0
    assert sampler.stats == {}
