"""The candidate draw (`metrale.sampling.candidates`) against the sampler's full-row torch path.

Both paths get the same rows; seeded rows draw from `row_uniform(seed, step)` whichever path
runs, so they must pick the same tokens, with the same raw logprobs, ranks and unsamplable
rows. The rows mix temperatures, top-k (1 to 300), top-p, min-p, penalties, greedy rows,
exactly tied logits (as bf16 logits tie), rows tied past their candidates (re-routed), -inf,
NaN and +inf logits.
"""

from __future__ import annotations

import pytest
import torch

from metrale.errors import MetraleError
from metrale.kernels import KernelOps, reference
from metrale.sampling import SamplingParams
from metrale.sampling.candidates import K_MAX, candidate_width
from metrale.sampling.sampler import Sampler, SamplingRow

VOCAB = 4000


def _random_rows(g: torch.Generator, batch: int, salt: int) -> list[SamplingRow]:
    rows = []
    for i in range(batch):
        pick = torch.randint(0, 1000, (6,), generator=g).tolist()
        if pick[0] % 9 == 0:
            params = SamplingParams(temperature=0.0)
        else:
            params = SamplingParams(
                seed=salt * 1000 + i,
                temperature=[0.3, 0.7, 0.8, 1.0, 1.6][pick[1] % 5],
                top_k=[1, 2, 7, 20, 50, 300][pick[2] % 6],
                top_p=[1.0, 0.95, 0.8, 0.3][pick[3] % 4],
                min_p=[0.0, 0.0, 0.02, 0.2][pick[4] % 4],
                repetition_penalty=1.3 if pick[5] % 7 == 0 else 1.0,
            )
        rows.append(SamplingRow(params, output_token_ids=[3, 5, pick[5] % VOCAB] * (i % 3)))
    return rows


def _logits(g: torch.Generator, batch: int, ties: bool) -> torch.Tensor:
    logits = torch.randn(batch, VOCAB, generator=g) * 3.0
    if ties:
        logits = torch.round(logits * 4) / 4  # many exact ties, as in bf16 logits
    logits[0, 7:] = float("-inf")  # fewer finite logits than most k
    logits[1] = float("-inf")  # unsamplable
    logits[2, 11] = float("nan")  # NaN: re-routed (topk ranks NaN first)
    logits[3, 40] = float("inf")  # +inf reads as the float32 max
    logits[4] = 0.0  # every logit tied: any k < V spills past the candidates
    logits[5, 100:130] = 9.0  # 30 ties at the top: within the candidates
    return logits


def _assert_same(full, fast) -> None:  # type: ignore[no-untyped-def]
    assert fast.token_ids == full.token_ids
    assert fast.unsamplable_rows == full.unsamplable_rows
    assert fast.ranks == full.ranks
    torch.testing.assert_close(
        torch.tensor(fast.logprobs), torch.tensor(full.logprobs), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("ties", [False, True])
def test_candidate_draw_picks_the_full_row_tokens(ties: bool) -> None:
    g = torch.Generator().manual_seed(11 + ties)
    fast = Sampler()
    batches = 0
    for step in range(12):
        batch = 24
        logits = _logits(g, batch, ties)
        rows = _random_rows(g, batch, step)
        full = Sampler(candidate_k_max=None)(logits, rows)
        out = fast(logits, rows)
        _assert_same(full, out)
        # The NaN row and the all-tied row never draw on their candidates.
        assert {2, 4} <= set(out.rerouted_rows)
        assert full.rerouted_rows == []
        batches += 1
    assert fast.stats["candidates"] == batches
    assert fast.stats["candidate_rerouted_rows"] >= 2 * batches


def test_candidate_draw_logprobs_are_exact_on_cpu() -> None:
    """On the CPU both paths take the raw logprob from the same torch ops: equal bits."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, VOCAB, generator=g)
    rows = [SamplingRow(SamplingParams(seed=i, top_k=40, top_p=0.9)) for i in range(8)]
    full = Sampler(candidate_k_max=None)(logits, rows)
    out = Sampler()(logits, rows)
    assert out.token_ids == full.token_ids
    assert out.logprobs == full.logprobs


def test_seeded_row_draws_the_same_token_alone_and_in_any_batch() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.round(torch.randn(16, VOCAB, generator=g) * 8) / 8
    target = SamplingRow(SamplingParams(seed=77, top_k=50, top_p=0.95, temperature=0.8))
    alone = Sampler()(logits[5:6], [target]).token_ids[0]
    rows = _random_rows(g, 16, 9)
    rows[5] = target
    assert Sampler()(logits, rows).token_ids[5] == alone
    # ... and through the full-row path.
    assert Sampler(candidate_k_max=None)(logits[5:6], [target]).token_ids[0] == alone


def test_device_route_reroutes_through_the_full_row_op_without_host_checks() -> None:
    """With an op set whose `top_k_top_p_sample` is a kernel (here the reference, tagged as
    one), re-routed rows go through it with `active=` and `temperature=`, as on CUDA."""
    calls: list[dict[str, object]] = []

    def full_row(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs)
        return reference.top_k_top_p_sample(*args, **kwargs)

    ops = KernelOps(
        top_k_top_p_sample=full_row,
        implementations={"top_k_top_p_sample": "triton", "token_logprobs": "torch"},
    )
    g = torch.Generator().manual_seed(21)
    for step in range(4):
        logits = _logits(g, 20, ties=True)
        rows = _random_rows(g, 20, step)
        full = Sampler(candidate_k_max=None)(logits, rows)
        sampler = Sampler(ops=ops)
        out = sampler(logits, rows)
        _assert_same(full, out)
        assert {2, 4} <= set(out.rerouted_rows)
        assert sampler.stats["candidates"] == 1
    assert len(calls) == 4
    assert all(call["active"] is not None and call["temperature"] is not None for call in calls)


def test_batches_the_candidates_cannot_take_are_counted() -> None:
    logits = torch.randn(3, VOCAB)
    sampler = Sampler()
    rows = [
        SamplingRow(SamplingParams(seed=1, top_k=20)),
        SamplingRow(SamplingParams(seed=2, top_p=0.9)),  # no top-k: the full row
    ]
    sampler(logits[:2], rows)
    sampler(logits[:1], [SamplingRow(SamplingParams(seed=3, top_k=K_MAX + 1))])
    sampler(logits[:1], [SamplingRow(SamplingParams(seed=4, top_k=10))])
    assert sampler.stats["full_row:a sampled row without a top-k"] == 1
    assert sampler.stats["full_row:a top-k above the candidate bound"] == 1
    assert sampler.stats["candidates"] == 1
    assert sampler.stats["torch"] == 2


def test_top_alternatives_come_from_the_full_row() -> None:
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, VOCAB, generator=g)
    rows = [SamplingRow(SamplingParams(seed=i, top_k=30, logprobs=3)) for i in range(4)]
    full = Sampler(candidate_k_max=None)(logits, rows)
    out = Sampler()(logits, rows)
    assert out.token_ids == full.token_ids
    assert out.top_logprobs == full.top_logprobs


def test_candidate_width() -> None:
    assert candidate_width(1, 1000) == 64
    assert candidate_width(50, 151_936) == 128
    assert candidate_width(64, 151_936) == 128
    assert candidate_width(65, 151_936) == 256
    assert candidate_width(K_MAX, 151_936) == 2048
    assert candidate_width(300, 500) == 500


def test_candidate_bound_is_checked() -> None:
    with pytest.raises(MetraleError, match="candidate_k_max"):
        Sampler(candidate_k_max=K_MAX + 1)
    with pytest.raises(MetraleError, match="candidate_k_max"):
        Sampler(candidate_k_max=0)
