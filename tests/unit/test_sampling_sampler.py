"""The batched sampler: distributions, filters, seeds, penalties, logprobs, bad logits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from metrale.errors import MetraleError
from metrale.sampling import SamplingParams
from metrale.sampling.sampler import Sampler, SamplerOutput, SamplingRow, row_uniform

NEG_INF = float("-inf")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class _OnDevice:
    """A `Sampler` fed with logits moved to `device` (the tests build them on the CPU)."""

    def __init__(self, device: str, seed: int | None = None) -> None:
        self.sampler = Sampler(seed=seed)
        self.device = device

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.sampler(logits.to(self.device), rows)


def _logits(rows: int, vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value (regularised upper incomplete gamma)."""
    total = float(observed.sum())
    expected = expected_probs.double() * total
    statistic = float(((observed.double() - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def _draw_histogram(
    logits_row: torch.Tensor, params: SamplingParams, draws: int, device: str
) -> torch.Tensor:
    sampler = _OnDevice(device, seed=1234)
    batch = logits_row.unsqueeze(0).expand(draws, -1)
    out = sampler(batch, [SamplingRow(params)] * draws)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel())


# ------------------------------------------------------------------------------------------
# Distribution
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_softmax(temperature: float, device: str) -> None:
    logits = torch.linspace(-2.0, 2.0, 24) + 0.3 * _logits(1, 24, seed=7)[0]
    counts = _draw_histogram(logits, SamplingParams(temperature=temperature), 20_000, device)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    assert _chi_square_p_value(counts, expected) > 1e-3
    # The same check rejects the other temperature's distribution: the test can fail.
    other = torch.softmax(logits.double() / (1.5 - temperature), dim=-1)
    assert _chi_square_p_value(counts, other) < 1e-6


def test_seeded_rows_follow_softmax_across_seeds(device: str) -> None:
    vocab, draws = 16, 4000
    logits = torch.linspace(-1.5, 1.5, vocab)
    rows = [SamplingRow(SamplingParams(seed=s)) for s in range(draws)]
    out = _OnDevice(device, seed=0)(logits.unsqueeze(0).expand(draws, -1), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab)
    assert _chi_square_p_value(counts, torch.softmax(logits.double(), dim=-1)) > 1e-3


# ------------------------------------------------------------------------------------------
# Filters
# ------------------------------------------------------------------------------------------


def _kept_set(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept mask, renormalised probabilities), computed independently in float64."""
    z = logits.double() / params.temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if params.top_k > 0:
        kth = torch.sort(z, descending=True).values[params.top_k - 1]
        keep &= z >= kth
    probs = torch.softmax(z.masked_fill(~keep, NEG_INF), dim=-1)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()
    probs = probs * keep
    if params.top_p < 1:
        order = torch.argsort(probs, descending=True)
        total = float(probs.sum())
        above = 0.0
        nucleus = torch.zeros_like(keep)
        for token in order.tolist():
            if probs[token] == 0:
                break
            if above < params.top_p * total:
                nucleus[token] = True
            above += float(probs[token])
        keep &= nucleus
    probs = probs * keep
    return keep, probs / probs.sum()


FILTER_CASES = [
    SamplingParams(top_k=5),
    SamplingParams(top_k=1),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9, temperature=0.7),
    SamplingParams(min_p=0.2),
    SamplingParams(min_p=0.05, temperature=1.3),
    SamplingParams(top_k=8, top_p=0.7),
    SamplingParams(top_k=10, min_p=0.1),
    SamplingParams(min_p=0.1, top_p=0.6),
    SamplingParams(top_k=12, min_p=0.03, top_p=0.8, temperature=0.8),
    SamplingParams(top_k=6, top_p=0.75, seed=99),
    SamplingParams(),
]


def test_filters_never_emit_dropped_tokens_and_reach_every_kept_token(device: str) -> None:
    vocab, per_case = 40, 1500
    logits_per_case = _logits(len(FILTER_CASES), vocab, seed=11, scale=2.0)
    rows: list[SamplingRow] = []
    batch_logits: list[torch.Tensor] = []
    # Interleave the cases so every stage runs over a subset of the batch.
    for draw in range(per_case):
        for case, params in enumerate(FILTER_CASES):
            # Seeded cases: one seed per draw, so the draws are independent.
            seed = None if params.seed is None else params.seed + draw
            rows.append(SamplingRow(params, output_token_ids=[0] * (draw % 7), seed=seed))
            batch_logits.append(logits_per_case[case])
    out = _OnDevice(device, seed=5)(torch.stack(batch_logits), rows)
    tokens = torch.tensor(out.token_ids).view(per_case, len(FILTER_CASES))
    for case, params in enumerate(FILTER_CASES):
        keep, probs = _kept_set(logits_per_case[case], params)
        drawn = tokens[:, case]
        assert keep[drawn].all(), f"{params} emitted a token outside its kept set"
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[drawn] = True
        likely = probs * per_case >= 25
        assert seen[likely].all(), f"{params} never emitted a kept token"
        if 0 < keep.sum() < vocab:
            assert not seen[~keep].any()


def test_top_k_larger_than_vocab_keeps_everything(device: str) -> None:
    logits = torch.zeros(1, 4)
    counts = _draw_histogram(logits[0], SamplingParams(top_k=100), 400, device)
    assert (counts > 0).all()


# ------------------------------------------------------------------------------------------
# Seeds
# ------------------------------------------------------------------------------------------


def _step_logits(step: int, vocab: int) -> torch.Tensor:
    # Nearly flat: any dependence of the draw on the batch shows up as a different token.
    return _logits(1, vocab, seed=1000 + step, scale=0.3)[0]


def _run_seeded(
    seed: int,
    steps: int,
    vocab: int,
    *,
    layout: str,
    device: str,
    sampler_seed: int = 0,
) -> list[int]:
    """A seeded sequence sampled step by step, its row placed in batches per `layout`."""
    sampler = _OnDevice(device, seed=sampler_seed)
    params = SamplingParams(seed=seed, top_p=0.95)
    neighbour_gen = torch.Generator().manual_seed(sampler_seed + 77)
    tokens: list[int] = []
    for step in range(steps):
        row = SamplingRow(params, output_token_ids=list(tokens), prompt_token_ids=[1, 2])
        logits = _step_logits(step, vocab)
        if layout == "alone":
            out = sampler(logits.unsqueeze(0), [row])
            tokens.append(out.token_ids[0])
            continue
        size = 2 + (step * 5) % 9
        position = (step * 3) % size
        rows: list[SamplingRow] = []
        batch = torch.randn(size, vocab, generator=neighbour_gen)
        for i in range(size):
            if i == position:
                rows.append(row)
                batch[i] = logits
                continue
            kind = (i + step) % 4
            other = (
                SamplingParams(seed=seed + 1 + i)
                if kind == 0
                else SamplingParams(temperature=0.0)
                if kind == 1
                else SamplingParams(top_k=3, frequency_penalty=0.5)
                if kind == 2
                else SamplingParams(seed=seed, temperature=0.7)
            )
            rows.append(SamplingRow(other, output_token_ids=[0] * ((step + i) % 5)))
        out = sampler(batch, rows)
        tokens.append(out.token_ids[position])
    return tokens


def test_seeded_row_repeats_across_runs_and_batches(device: str) -> None:
    vocab, steps = 500, 40
    alone = _run_seeded(42, steps, vocab, layout="alone", device=device)
    assert _run_seeded(42, steps, vocab, layout="alone", device=device, sampler_seed=9) == alone
    assert _run_seeded(42, steps, vocab, layout="mixed", device=device) == alone
    assert _run_seeded(42, steps, vocab, layout="mixed", device=device, sampler_seed=3) == alone
    # The draw changes with the step (not one uniform reused every step).
    assert len(set(alone)) > steps // 2


def test_seeded_step_is_independent_of_earlier_calls(device: str) -> None:
    vocab = 500
    full = _run_seeded(7, 30, vocab, layout="alone", device=device)
    # A fresh sampler asked for step 20 (as after preemption and resume) gives the same token.
    row = SamplingRow(SamplingParams(seed=7, top_p=0.95), output_token_ids=full[:20])
    resumed = _OnDevice(device, seed=123)(_step_logits(20, vocab).unsqueeze(0), [row])
    assert resumed.token_ids[0] == full[20]


def test_row_seed_overrides_params_seed(device: str) -> None:
    vocab = 500
    logits = _step_logits(0, vocab).unsqueeze(0).expand(3, -1)
    params = SamplingParams(seed=42)
    out = _OnDevice(device, seed=0)(
        logits,
        [SamplingRow(params), SamplingRow(params, seed=42), SamplingRow(params, seed=43)],
    )
    assert out.token_ids[0] == out.token_ids[1]
    more = _OnDevice(device, seed=1)(logits[:1], [SamplingRow(params, seed=43)])
    assert more.token_ids[0] == out.token_ids[2]


def test_different_seeds_give_different_sequences(device: str) -> None:
    vocab, steps = 500, 40
    sequences = [
        _run_seeded(seed, steps, vocab, layout="alone", device=device) for seed in (1, 2, 3)
    ]
    for a in range(3):
        for b in range(a + 1, 3):
            same = sum(x == y for x, y in zip(sequences[a], sequences[b]))
            assert same < steps // 4


def test_unseeded_sampler_seed_makes_runs_repeat(device: str) -> None:
    logits = _logits(64, 100, seed=3, scale=0.5)
    rows = [SamplingRow(SamplingParams())] * 64
    first = _OnDevice(device, seed=8)(logits, rows).token_ids
    assert _OnDevice(device, seed=8)(logits, rows).token_ids == first
    assert _OnDevice(device, seed=9)(logits, rows).token_ids != first


# ------------------------------------------------------------------------------------------
# Greedy, penalties, bias, min_tokens
# ------------------------------------------------------------------------------------------


def _reference_processed(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Stage 1 written out element by element, independently of the processors."""
    p = row.params
    out = logits.double().clone()
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for token in range(out.numel()):
        value = float(out[token])
        if token in seen and p.repetition_penalty != 1.0:
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        count = list(row.output_token_ids).count(token)
        value -= count * p.frequency_penalty + (1 if count else 0) * p.presence_penalty
        value += (p.logit_bias or {}).get(token, 0.0)
        if len(row.output_token_ids) < p.min_tokens and (
            token in row.eos_token_ids or token in p.stop_token_ids
        ):
            value = NEG_INF
        out[token] = value
    return out


def test_greedy_is_argmax_of_processed_logits(device: str) -> None:
    vocab = 12
    logits = _logits(6, vocab, seed=21, scale=1.0)
    logits[:, 3] = 4.0  # token 3 dominates the raw logits
    rows = [
        SamplingRow(SamplingParams(temperature=0.0)),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=8.0), prompt_token_ids=[3]),
        SamplingRow(
            SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
            output_token_ids=[3, 3, 5],
        ),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias={"7": 50.0})),
        SamplingRow(
            SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
            output_token_ids=[1],
        ),
        SamplingRow(
            SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=-0.5),
            output_token_ids=[2, 3],
            prompt_token_ids=[4, 9],
        ),
    ]
    out = _OnDevice(device, seed=0)(logits, rows)
    expected = [int(_reference_processed(logits[i], row).argmax()) for i, row in enumerate(rows)]
    assert out.token_ids == expected
    assert out.token_ids[0] == 3 and out.token_ids[3] == 7
    assert out.token_ids[1] != 3 and out.token_ids[2] != 3 and out.token_ids[4] != 3


def test_greedy_ties_pick_lowest_id(device: str) -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0]])
    out = _OnDevice(device)(logits, [SamplingRow(SamplingParams(temperature=0.0))])
    assert out.token_ids == [1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached(device: str) -> None:
    vocab = 8
    logits = torch.zeros(1, vocab)
    logits[0, 0] = 10.0  # eos
    logits[0, 5] = 9.0  # a stop token id
    # ignore_eos does not change sampling: EOS is masked by min_tokens all the same.
    params = SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=True)
    greedy_params = params.replace(temperature=0.0)
    eos = frozenset({0})
    sampler = _OnDevice(device, seed=1)
    for produced in range(3):
        output = [1] * produced
        rows = [SamplingRow(params, output, eos_token_ids=eos)] * 500
        drawn = sampler(logits.expand(500, -1), rows).token_ids
        assert 0 not in drawn and 5 not in drawn
        greedy = sampler(logits, [SamplingRow(greedy_params, output, eos_token_ids=eos)])
        assert greedy.token_ids[0] not in (0, 5)
    reached = [1, 1, 1]
    greedy = sampler(logits, [SamplingRow(greedy_params, reached, eos_token_ids=eos)])
    assert greedy.token_ids == [0]
    rows = [SamplingRow(params, reached, eos_token_ids=eos)] * 200
    drawn = sampler(logits.expand(200, -1), rows).token_ids
    assert drawn.count(0) > 100 and 5 in drawn


def test_penalties_affect_sampled_rows_too(device: str) -> None:
    vocab = 6
    logits = torch.zeros(1, vocab)
    logits[0, 2] = 5.0
    rows = [
        SamplingRow(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0), [2, 2, 2])
    ] * 2000
    drawn = _OnDevice(device, seed=4)(logits.expand(2000, -1), rows).token_ids
    # Processed logit of token 2: 5 - (3 * 2 + 2) = -3, far below the others (0).
    processed = _reference_processed(logits[0], rows[0])
    expected = torch.softmax(processed, dim=-1)
    counts = torch.bincount(torch.tensor(drawn), minlength=vocab)
    assert _chi_square_p_value(counts, expected) > 1e-3


# ------------------------------------------------------------------------------------------
# Logprobs
# ------------------------------------------------------------------------------------------


def _check_logprobs(out: SamplerOutput, raw: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    reference = torch.log_softmax(raw.double(), dim=-1)
    for i, row in enumerate(rows):
        token = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(float(reference[i, token]), abs=1e-5)
        assert out.ranks[i] == int((reference[i] > reference[i, token]).sum()) + 1
        wanted = row.params.logprobs or 0
        if out.top_logprobs is None:
            assert wanted == 0
            continue
        top = out.top_logprobs[i]
        assert len(top) == wanted
        values, ids = reference[i].topk(max(wanted, 1))
        for j, (token_id, logprob) in enumerate(top):
            assert token_id == int(ids[j])
            assert logprob == pytest.approx(float(values[j]), abs=1e-5)


def test_logprobs_ranks_and_top_n_come_from_raw_logits(device: str) -> None:
    vocab = 30
    raw = _logits(5, vocab, seed=31)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5)),
        SamplingRow(SamplingParams(temperature=0.5, logprobs=3, logit_bias={4: 30.0})),
        SamplingRow(SamplingParams(top_k=2, logprobs=0, repetition_penalty=2.0), [1], [2]),
        SamplingRow(SamplingParams(logprobs=None, presence_penalty=1.0), [0, 1]),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=20, logit_bias={9: 100.0})),
    ]
    out = _OnDevice(device, seed=2)(raw, rows)
    assert out.top_logprobs is not None
    assert out.top_logprobs[2] == [] and out.top_logprobs[3] == []
    _check_logprobs(out, raw, rows)
    # The biased rows chose the biased token, yet report its raw logprob and rank.
    assert out.token_ids[1] == 4 and out.token_ids[4] == 9
    assert out.ranks[4] == int((raw[4] > raw[4, 9]).sum()) + 1


def test_top_logprobs_none_when_no_row_asks(device: str) -> None:
    raw = _logits(3, 10, seed=1)
    rows = [
        SamplingRow(SamplingParams()),
        SamplingRow(SamplingParams(logprobs=0)),
        SamplingRow(SamplingParams(temperature=0.0)),
    ]
    out = _OnDevice(device, seed=0)(raw, rows)
    assert out.top_logprobs is None
    _check_logprobs(out, raw, rows)
    assert out.ranks[2] == 1


def test_bfloat16_logits_and_input_not_modified(device: str) -> None:
    raw = _logits(4, 50, seed=5).to(torch.bfloat16)
    before = raw.clone()
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.3), [1]),
        SamplingRow(SamplingParams(top_p=0.8, logit_bias={3: 2.0})),
        SamplingRow(SamplingParams(min_p=0.1, frequency_penalty=0.3), [3, 3]),
        SamplingRow(SamplingParams(temperature=0.0, min_tokens=1), eos_token_ids=frozenset({0})),
    ]
    out = _OnDevice(device, seed=0)(raw, rows)
    assert torch.equal(raw, before)
    _check_logprobs(out, raw.float(), rows)
    float_raw = raw.float()
    float_before = float_raw.clone()
    _OnDevice(device, seed=0)(float_raw, rows)
    assert torch.equal(float_raw, float_before)


# ------------------------------------------------------------------------------------------
# Bad logits and edge cases
# ------------------------------------------------------------------------------------------


def test_unsamplable_rows_fall_back_without_failing_the_batch(device: str) -> None:
    vocab = 6
    raw = _logits(6, vocab, seed=8)
    raw[1] = float("nan")
    raw[2] = NEG_INF
    raw[3, 4] = float("inf")
    raw[4, 2] = float("nan")
    rows = [
        SamplingRow(SamplingParams(logprobs=2)),
        SamplingRow(SamplingParams(logprobs=2)),
        SamplingRow(SamplingParams(temperature=0.0)),
        SamplingRow(SamplingParams(top_p=0.5)),
        SamplingRow(SamplingParams(temperature=0.0)),
        # min_tokens masks every token of this row: eos + stop ids cover the vocab.
        SamplingRow(
            SamplingParams(min_tokens=1, stop_token_ids=[1, 2, 3, 4, 5]),
            eos_token_ids=frozenset({0}),
        ),
    ]
    out = _OnDevice(device, seed=0)(raw, rows)
    assert out.unsamplable_rows == [1, 2, 5]
    assert out.token_ids[3] == 4  # +inf reads as the most likely token
    assert out.token_ids[4] != 2  # NaN reads as -inf
    assert out.token_ids[5] == int(raw[5].argmax())  # fallback: raw argmax
    assert out.logprobs[1] == NEG_INF and out.logprobs[2] == NEG_INF
    assert all(0 <= t < vocab for t in out.token_ids)
    assert math.isfinite(out.logprobs[0])


def test_out_of_vocab_ids_in_params_are_ignored(device: str) -> None:
    raw = torch.zeros(1, 4)
    row = SamplingRow(
        SamplingParams(
            temperature=0.0, logit_bias={99: 100.0, 2: 1.0}, min_tokens=1, stop_token_ids=[50]
        ),
        output_token_ids=[7],  # an id the model does not have: not counted
        eos_token_ids=frozenset({1000}),
    )
    assert _OnDevice(device)(raw, [row]).token_ids == [2]


def test_empty_batch_and_shape_mismatch(device: str) -> None:
    out = _OnDevice(device)(torch.zeros(0, 5), [])
    assert out.token_ids == [] and out.top_logprobs is None and out.unsamplable_rows == []
    with pytest.raises(MetraleError):
        _OnDevice(device)(torch.zeros(2, 5), [SamplingRow(SamplingParams())])


# ------------------------------------------------------------------------------------------
# Seeded uniforms
# ------------------------------------------------------------------------------------------


def test_row_uniform_is_a_pure_function_of_seed_and_step() -> None:
    assert row_uniform(5, 3) == row_uniform(5, 3)
    values = [row_uniform(seed, step) for seed in range(100) for step in range(100)]
    assert len(set(values)) == len(values)
    assert all(0.0 < v < 1.0 for v in values)
    u = torch.tensor(values, dtype=torch.float64)
    assert float(u.mean()) == pytest.approx(0.5, abs=0.01)
    assert float(u.var()) == pytest.approx(1 / 12, abs=0.003)
    # Consecutive steps of one seed are not correlated.
    by_seed = u.view(100, 100)
    corr = torch.corrcoef(torch.stack([by_seed[:, :-1].flatten(), by_seed[:, 1:].flatten()]))
    assert abs(float(corr[0, 1])) < 0.05
    # Large and negative seeds are fine.
    assert 0.0 < row_uniform(-(2**70), 2**40) < 1.0


def test_zero_probability_tokens_are_never_drawn(device: str) -> None:
    # Extreme logits: the kept tokens' probabilities span far below float32's resolution of 1.
    logits = torch.full((1, 64), NEG_INF)
    logits[0, 10] = 0.0
    logits[0, 40] = -30.0
    logits[0, 63] = -60.0
    out = _OnDevice(device, seed=0)(logits.expand(3000, -1), [SamplingRow(SamplingParams())] * 3000)
    assert set(out.token_ids) <= {10, 40, 63}
    assert out.token_ids.count(10) > 2900
