"""Lossless draft verification (`Sampler.verify`): greedy chains, the rejection sampler's exact
distribution (chi-square), seeded reproducibility, layout edge cases and logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import metrale.sampling.verify as verify_module
from metrale.errors import MetraleError
from metrale.sampling import SamplingParams
from metrale.sampling.sampler import Sampler, SamplerOutput, SamplingRow, gather_logprobs

NEG_INF = float("-inf")
GREEDY = SamplingParams(temperature=0.0)


def _logits(rows: int, vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _offsets(drafts: Sequence[Sequence[int]]) -> list[int]:
    offsets = [0]
    for draft in drafts:
        offsets.append(offsets[-1] + len(draft) + 1)
    return offsets


def _per_row(out: SamplerOutput, drafts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each row's emitted tokens, checking that `emitted` is a non-empty prefix of the row."""
    assert out.emitted is not None
    offsets = _offsets(drafts)
    result = []
    for i in range(len(drafts)):
        flags = out.emitted[offsets[i] : offsets[i + 1]]
        count = sum(flags)
        assert count >= 1 and flags == [True] * count + [False] * (len(flags) - count)
        result.append(out.token_ids[offsets[i] : offsets[i] + count])
    return result


def _expanded(row: SamplingRow, drafts: Sequence[int], j: int) -> SamplingRow:
    """`row` as `sample` would see it with `drafts[:j]` appended to its output."""
    return SamplingRow(
        params=row.params,
        output_token_ids=list(row.output_token_ids) + list(drafts[:j]),
        prompt_token_ids=row.prompt_token_ids,
        seed=row.seed,
        eos_token_ids=row.eos_token_ids,
    )


# -------------------------------------------------------------------------------------------
# Greedy
# -------------------------------------------------------------------------------------------


def test_greedy_emits_the_argmax_chain() -> None:
    vocab = 12
    drafts_shape = [4, 4, 4, 0, 3]
    logits = _logits(sum(k + 1 for k in drafts_shape), vocab, seed=1)
    argmax = logits.argmax(dim=-1).tolist()
    offsets = _offsets([[0] * k for k in drafts_shape])
    chain = [argmax[offsets[i] : offsets[i + 1]] for i in range(len(drafts_shape))]
    wrong = [(t + 1) % vocab for t in argmax]
    drafts = [
        chain[0][:4],  # all match: 4 accepted, then the bonus
        [*chain[1][:2], wrong[offsets[1] + 2], chain[1][3]],  # mismatch at 2
        [wrong[offsets[2]], *chain[2][1:4]],  # mismatch at 0
        [],  # no drafts: one token
        chain[4][:3],
    ]
    out = Sampler().verify(logits, [SamplingRow(GREEDY) for _ in drafts], drafts).to_host()
    assert out.token_ids == argmax  # every position holds its argmax, emitted or not
    emitted = _per_row(out, drafts)
    assert [len(e) - 1 for e in emitted] == [4, 2, 0, 0, 3]
    assert emitted == [chain[i][: len(emitted[i])] for i in range(len(drafts))]
    assert out.unsamplable_rows == []


def test_greedy_penalties_see_the_draft_prefix() -> None:
    """Repetition / frequency penalties at position j count drafts[:j]: a drafted token that
    wins on raw logits loses at the next position, exactly as in sequential `sample` calls."""
    vocab = 8
    logits = torch.zeros(4, vocab)
    logits[0, 3] = 2.0  # position 0: 3 wins
    logits[1, 3], logits[1, 5] = 2.0, 1.5  # raw: 3 wins; 3 penalised (2.0 / 2): 5 wins
    logits[2, 5], logits[2, 6] = 2.0, 1.2  # after 3, 5 both seen: 5 -> 1.0 < 1.2
    logits[3, 1] = 1.0
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.1)
    row = SamplingRow(params, output_token_ids=[0], prompt_token_ids=[7])
    sampler = Sampler()
    for drafts, accepted in (([3, 3, 6], 1), ([3, 5, 6], 3), ([3, 5], 2)):
        out = sampler.verify(logits[: len(drafts) + 1], [row], [drafts]).to_host()
        emitted = _per_row(out, [drafts])[0]
        assert len(emitted) == accepted + 1
        # Sequential decoding: each token sampled with the previous ones in the output.
        sequential: list[int] = []
        for j in range(accepted + 1):
            step_row = _expanded(row, sequential, len(sequential))
            sequential.append(sampler(logits[j : j + 1], [step_row]).token_ids[0])
        assert emitted == sequential
        # And every position's target is `sample` given the draft prefix.
        for j in range(len(drafts) + 1):
            expected = sampler(logits[j : j + 1], [_expanded(row, drafts, j)]).token_ids[0]
            assert out.token_ids[j] == expected
    assert _per_row(sampler.verify(logits, [row], [[3, 3, 6]]).to_host(), [[3, 3, 6]]) == [[3, 5]]


# -------------------------------------------------------------------------------------------
# The rejection sampler's distribution
# -------------------------------------------------------------------------------------------


def _reference_probs(
    logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> torch.Tensor:
    """The processed distribution, written out independently in float64."""
    x = logits.double().clone()
    vocab = x.numel()
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = (
                x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
            )
    for t in set(output):
        x[t] -= output.count(t) * params.frequency_penalty + params.presence_penalty
    x = x / params.temperature
    if 0 < params.top_k < vocab:
        kth = x.sort(descending=True).values[params.top_k - 1]
        x[x < kth] = NEG_INF
    p = torch.softmax(x, dim=0)
    if params.min_p > 0:
        p[p < params.min_p * p.max()] = 0.0
    if params.top_p < 1.0:
        total = float(p.sum())
        mass_above = 0.0
        for t in p.argsort(descending=True).tolist():
            if mass_above >= params.top_p * total:
                mass_above += float(p[t])
                p[t] = 0.0
            else:
                mass_above += float(p[t])
    return p / p.sum()


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against `probs` (flat, same length).

    A count in a zero-probability cell is an outright rejection (p-value 0). Cells expecting
    fewer than 5 are pooled into one (the chi-square approximation needs it)."""
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    if float(counts[probs == 0].sum()) > 0:
        return 0.0
    total = float(counts.sum())
    expected = probs * total
    big = expected >= 5.0
    small = (probs > 0) & ~big
    observed_cells = counts[big].tolist()
    expected_cells = expected[big].tolist()
    if bool(small.any()):
        observed_cells.append(float(counts[small].sum()))
        expected_cells.append(float(expected[small].sum()))
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed_cells, expected_cells))
    dof = len(observed_cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


class _Model:
    """A tiny fixed 'target': logits for the first token (`first`), for the second given the
    first (`second[a]`), and a filler row for the bonus after two drafts."""

    def __init__(self, vocab: int, seed: int, boost_repeat: float = 0.0) -> None:
        table = _logits(vocab + 2, vocab, seed)
        self.vocab = vocab
        self.first = table[0]
        self.second = table[1 : vocab + 1].clone()
        self.second += boost_repeat * torch.eye(vocab)  # makes repeating a token tempting
        self.filler = table[vocab + 1]

    def joint(self, params: SamplingParams, prompt: Sequence[int]) -> torch.Tensor:
        """P(t0, t1) `[V, V]`: the processed p0(t0) times p1(t1 | output [t0])."""
        p0 = _reference_probs(self.first, params, prompt, [])
        rows = [_reference_probs(self.second[a], params, prompt, [a]) for a in range(self.vocab)]
        return p0.unsqueeze(1) * torch.stack(rows)


def _two_token_counts(
    model: _Model,
    params: SamplingParams,
    prompt: list[int],
    d0: int,
    d1: int,
    samples: int,
    seed: int,
) -> torch.Tensor:
    """Counts `[V, V]` of the first two tokens a spec decoder emits with drafts `[d0, d1]`,
    `samples` independent seeded sequences: one verify over all of them, then for those that
    emitted only one token a second verify from that token (drafting `(t0 + 1) % V`)."""
    vocab = model.vocab
    sampler = Sampler(seed=seed)
    rows = [SamplingRow(params, prompt_token_ids=prompt, seed=seed + m) for m in range(samples)]
    logits = torch.stack([model.first, model.second[d0], model.filler]).repeat(samples, 1)
    out = sampler.verify(logits, rows, [[d0, d1]] * samples).to_host()
    assert out.emitted is not None and out.unsamplable_rows == []
    tokens = torch.tensor(out.token_ids).view(samples, 3)
    emitted = torch.tensor(out.emitted).view(samples, 3)
    assert bool(emitted[:, 0].all())
    first, second = tokens[:, 0], tokens[:, 1].clone()
    assert bool((first[emitted[:, 1]] == d0).all())  # position 1 only after accepting d0

    rest = (~emitted[:, 1]).nonzero().squeeze(1)
    rest_first = first[rest]
    rows2 = [
        SamplingRow(params, output_token_ids=[t], prompt_token_ids=prompt, seed=seed + m)
        for m, t in zip(rest.tolist(), rest_first.tolist())
    ]
    logits2 = torch.stack(
        [model.second[rest_first], model.filler.expand(len(rows2), vocab)], dim=1
    ).reshape(-1, vocab)
    drafts2 = [[(t + 1) % vocab] for t in rest_first.tolist()]
    out2 = sampler.verify(logits2, rows2, drafts2).to_host()
    second[rest] = torch.tensor(out2.token_ids, dtype=torch.int64).view(-1, 2)[:, 0]
    return torch.bincount(first * vocab + second, minlength=vocab * vocab).view(vocab, vocab)


_VOCAB = 10
_SAMPLES = 60_000
_PLAIN = SamplingParams(temperature=1.0)
_FILTERS = SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1)
_TOP_K = SamplingParams(temperature=1.0, top_k=3)
_REPEAT = SamplingParams(temperature=1.0, repetition_penalty=1.8, presence_penalty=0.3)


def _ranked(probs: torch.Tensor) -> list[int]:
    return probs.argsort(descending=True).tolist()


def _case(name: str) -> tuple[_Model, SamplingParams, list[int], int, int]:
    """(model, params, prompt, d0, d1) of a named distribution case."""
    if name == "repetition":
        model = _Model(_VOCAB, seed=11, boost_repeat=3.0)
        prompt = [2, 3]
        d0 = _ranked(_reference_probs(model.first, _REPEAT, prompt, []))[0]
        return model, _REPEAT, prompt, d0, d0  # draft the repeat the penalty punishes
    model = _Model(_VOCAB, seed=7)
    params = {"mode": _PLAIN, "low": _PLAIN, "masked": _TOP_K, "filters": _FILTERS}[name]
    p0 = _reference_probs(model.first, params, [], [])
    order = _ranked(p0)
    if name == "mode":
        d0 = order[0]
    elif name == "low":
        d0 = order[-2]  # a low-probability token
    elif name == "masked":
        d0 = order[-1]  # outside the top 3: p(d0) = 0
    else:
        d0 = order[1]
    p1 = _reference_probs(model.second[d0], params, [], [d0])
    d1 = {"mode": _ranked(p1)[0], "low": _ranked(p1)[-3], "masked": _ranked(p1)[5]}.get(
        name, _ranked(p1)[0]
    )
    return model, params, [], d0, d1


@pytest.mark.parametrize("name", ["mode", "low", "masked", "filters", "repetition"])
def test_emitted_tokens_follow_the_target_distribution(name: str) -> None:
    """The joint of the first two emitted tokens matches the target's (chi-square, p > 1e-3)."""
    model, params, prompt, d0, d1 = _case(name)
    joint = model.joint(params, prompt)
    p_d0 = float(joint.sum(dim=1)[d0])
    if name == "masked":
        assert p_d0 == 0.0
    elif name == "low":
        assert 0.0 < p_d0 < 0.1
    counts = _two_token_counts(model, params, prompt, d0, d1, _SAMPLES, seed=1000)
    assert _chi_square_p_value(counts, joint) > 1e-3


def _greedy_acceptance(probs: torch.Tensor, draft_ids: torch.Tensor, uniforms: torch.Tensor):
    """The classic mistake: accept a sampled row's draft iff it is the argmax."""
    return probs.argmax(dim=-1) == draft_ids


@pytest.mark.parametrize("name", ["mode", "low"])
def test_the_distribution_test_rejects_greedy_acceptance(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same statistic catches a lossy verifier (it is not vacuous)."""
    monkeypatch.setattr(verify_module, "accept_drafts", _greedy_acceptance)
    model, params, prompt, d0, d1 = _case(name)
    counts = _two_token_counts(model, params, prompt, d0, d1, _SAMPLES // 4, seed=1000)
    assert _chi_square_p_value(counts, model.joint(params, prompt)) < 1e-6


# -------------------------------------------------------------------------------------------
# Seeds and batch layout
# -------------------------------------------------------------------------------------------


def _mixed_batch() -> tuple[torch.Tensor, list[SamplingRow], list[list[int]]]:
    vocab = 16
    params = [
        SamplingParams(temperature=0.9, seed=5),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_k=6, top_p=0.9),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, min_p=0.05),
        SamplingParams(temperature=1.0, seed=9, logprobs=2),
    ]
    rows = [
        SamplingRow(
            p, output_token_ids=[1, 2, i], prompt_token_ids=[4], seed=(77 + i if i % 2 else None)
        )
        for i, p in enumerate(params)
    ]
    drafts = [[3, 3, 1, 0, 2], [], [5, 5], [1, 2, 3, 4, 5], [0]]
    logits = _logits(sum(len(d) + 1 for d in drafts), vocab, seed=3, scale=0.7)
    return logits, rows, drafts


def test_seeded_rows_repeat_and_ignore_their_neighbours() -> None:
    logits, rows, drafts = _mixed_batch()
    seeded = [i for i, row in enumerate(rows) if row.effective_seed is not None]
    assert len(seeded) >= 3
    offsets = _offsets(drafts)
    first = Sampler(seed=1).verify(logits, rows, drafts).to_host()
    again = Sampler(seed=2).verify(logits, rows, drafts).to_host()  # another host stream
    for i in seeded:
        span = slice(offsets[i], offsets[i + 1])
        assert first.token_ids[span] == again.token_ids[span]
        assert first.emitted is not None and again.emitted is not None
        assert first.emitted[span] == again.emitted[span]
        # Alone, or behind other neighbours, the row verifies the same way.
        alone = Sampler(seed=3).verify(logits[span], [rows[i]], [drafts[i]]).to_host()
        order = [i, *[j for j in range(len(rows)) if j != i][::-1]]
        shuffled = (
            Sampler(seed=4)
            .verify(
                torch.cat([logits[offsets[j] : offsets[j + 1]] for j in order]),
                [rows[j] for j in order],
                [drafts[j] for j in order],
            )
            .to_host()
        )
        width = span.stop - span.start
        assert alone.token_ids == first.token_ids[span] == shuffled.token_ids[:width]
        assert alone.emitted == first.emitted[span] == shuffled.emitted[:width]
    # The whole batch, with the same host seed, repeats too.
    assert Sampler(seed=1).verify(logits, rows, drafts).to_host() == first


def test_rows_without_drafts_draw_as_sample() -> None:
    """k = 0 rows (mixed with k = 5 rows) are ordinary draws: a seeded one gets `sample`'s
    token, and a batch of only k = 0 rows consumes the host stream as `sample` does."""
    vocab = 16
    params = SamplingParams(temperature=1.0, top_p=0.9)
    rows = [SamplingRow(params, output_token_ids=[1] * i, seed=100 + i) for i in range(6)]
    drafts = [[] if i % 2 else [1, 2, 3, 4, 5] for i in range(6)]
    logits = _logits(sum(len(d) + 1 for d in drafts), vocab, seed=8)
    offsets = _offsets(drafts)
    out = Sampler().verify(logits, rows, drafts).to_host()
    assert out.emitted is not None
    for i in range(1, 6, 2):
        position = offsets[i]
        alone = Sampler()(logits[position : position + 1], [rows[i]])
        assert out.token_ids[position] == alone.token_ids[0]
        assert out.emitted[position]
    unseeded = [SamplingRow(params, output_token_ids=[2] * i) for i in range(8)]
    plain = _logits(8, vocab, seed=9)
    verified = Sampler(seed=42).verify(plain, unseeded, [[]] * 8).to_host()
    assert verified.token_ids == Sampler(seed=42)(plain, unseeded).token_ids
    assert verified.emitted == [True] * 8


def test_the_bonus_is_the_seeded_draw_at_its_step() -> None:
    """All drafts accepted (each has p ~ 1): the bonus is `sample`'s seeded draw for the row
    with the drafts appended (same uniform, `row_uniform(seed, step + k)`)."""
    vocab = 12
    drafts = [4, 7, 1]
    logits = _logits(4, vocab, seed=10, scale=0.5)
    for j, t in enumerate(drafts):
        logits[j, t] = 40.0
    params = SamplingParams(temperature=1.0, presence_penalty=0.2)
    for seed in range(20):
        row = SamplingRow(params, output_token_ids=[3, 3], seed=seed)
        out = Sampler().verify(logits, [row], [drafts]).to_host()
        assert out.emitted == [True] * 4
        bonus = Sampler()(logits[3:4], [_expanded(row, drafts, 3)]).token_ids[0]
        assert out.token_ids == [*drafts, bonus]


def test_min_tokens_masks_eos_by_position() -> None:
    """EOS is masked while step + j < min_tokens: position j's distribution sees step + j."""
    vocab, eos = 8, 7
    logits = _logits(5, vocab, seed=12)
    logits[:, eos] = 10.0  # EOS is everyone's raw argmax
    second = logits[:, :eos].argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0, min_tokens=4)
    row = SamplingRow(params, output_token_ids=[0, 1], eos_token_ids=frozenset({eos}))
    # step 2 and 3 masked (min_tokens 4), step 4 allowed.
    drafts = [second[0], second[1], eos, 3]
    out = Sampler().verify(logits, [row], [drafts]).to_host()
    assert out.token_ids[:3] == [second[0], second[1], eos]
    assert out.emitted == [True, True, True, True, False]
    # The same row one token later: EOS allowed from position 1 on; drafting EOS at 0 fails.
    later = SamplingRow(params, output_token_ids=[0, 1, 2], eos_token_ids=frozenset({eos}))
    out = Sampler().verify(logits[:3], [later], [[eos, eos]]).to_host()
    assert out.token_ids == [second[0], eos, eos]
    assert out.emitted == [True, False, False]
    # Sampled rows: p(EOS) = 0 at masked positions, so a drafted EOS there is never accepted.
    sampled = SamplingParams(temperature=1.0, min_tokens=3)
    rows = [
        SamplingRow(sampled, output_token_ids=[0, 1], eos_token_ids=frozenset({eos}), seed=s)
        for s in range(200)
    ]
    out = Sampler().verify(logits[:3].repeat(200, 1), rows, [[eos, eos]] * 200).to_host()
    tokens = torch.tensor(out.token_ids).view(200, 3)
    assert out.emitted is not None
    emitted = torch.tensor(out.emitted).view(200, 3)
    assert not bool((tokens[:, 0] == eos).any())
    assert bool((emitted.sum(dim=1) == 1).all())


def test_logprobs_describe_the_raw_logits_per_position() -> None:
    logits, rows, drafts = _mixed_batch()
    rows = [
        SamplingRow(
            row.params.replace(logprobs=i + 1),
            output_token_ids=row.output_token_ids,
            prompt_token_ids=row.prompt_token_ids,
            seed=row.seed,
        )
        for i, row in enumerate(rows)
    ]
    out = Sampler(seed=6).verify(logits, rows, drafts).to_host()
    assert out.top_logprobs is not None
    tokens = torch.tensor(out.token_ids)
    logprobs, ranks, top_ids, top_lps = gather_logprobs(logits, tokens, 5)
    assert top_ids is not None and top_lps is not None
    offsets = _offsets(drafts)
    for i in range(len(rows)):
        for position in range(offsets[i], offsets[i + 1]):
            assert out.logprobs[position] == pytest.approx(float(logprobs[position]), abs=1e-6)
            assert out.ranks[position] == int(ranks[position])
            count = i + 1
            assert [t for t, _ in out.top_logprobs[position]] == top_ids[position, :count].tolist()
            assert [lp for _, lp in out.top_logprobs[position]] == pytest.approx(
                top_lps[position, :count].tolist(), abs=1e-6
            )


def test_an_unsamplable_position_ends_emission() -> None:
    vocab = 6
    logits = _logits(4, vocab, seed=13)
    logits[1] = float("nan")
    drafts = [int(logits[0].argmax()), 0, 3]  # 0: the fallback id at the NaN position
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=1)):
        row = SamplingRow(params)
        # Position 0's draft has p ~ 1 under the sampled params too.
        peaked = logits.clone()
        peaked[0, drafts[0]] = 50.0
        out = Sampler().verify(peaked, [row], [drafts]).to_host()
        assert out.unsamplable_rows == [1]
        assert out.emitted == [True, True, False, False]
        assert out.token_ids[:2] == [drafts[0], 0]  # the fallback: raw argmax, token 0 if none
        assert math.isinf(out.logprobs[1])


def test_pending_tokens_count_for_penalties() -> None:
    """A fed row (pending = 1) with its token given in `pending_tokens` verifies like the row
    with that token already in its output."""
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0)
    logits = torch.zeros(3, 6)
    logits[:, 2], logits[:, 4] = 2.0, 1.0
    fed = SamplingRow(params, output_token_ids=[1], pending=1)
    known = SamplingRow(params, output_token_ids=[1, 2])
    out_fed = Sampler().verify(logits, [fed], [[4, 2]], torch.tensor([2])).to_host()
    out_known = Sampler().verify(logits, [known], [[4, 2]]).to_host()
    assert out_fed == out_known
    # Without the pending 2 in the penalty, position 0 would pick 2 (raw argmax), not 4.
    assert out_fed.token_ids == [4, 2, 2] and out_fed.emitted == [True, True, True]
    out_unfed = Sampler().verify(logits, [SamplingRow(params, output_token_ids=[1])], [[4, 2]])
    assert out_unfed.to_host().token_ids[0] == 2
    with pytest.raises(MetraleError):
        Sampler().verify(logits, [fed], [[4, 2]])


def test_shape_mismatches_raise() -> None:
    sampler = Sampler()
    rows = [SamplingRow(GREEDY), SamplingRow(GREEDY)]
    with pytest.raises(MetraleError):
        sampler.verify(torch.zeros(4, 5), rows, [[1], [2, 3]])  # needs 5 rows
    with pytest.raises(MetraleError):
        sampler.verify(torch.zeros(3, 5), rows, [[1]])  # drafts for one row of two
    with pytest.raises(MetraleError):
        sampler.verify(torch.zeros(3, 5), rows, [[1], [5]])  # token outside the vocabulary
    with pytest.raises(MetraleError):
        sampler.verify(torch.zeros(3), rows, [[1], []])
    empty = sampler.verify(torch.zeros(0, 5), [], []).to_host()
    assert empty.token_ids == [] and empty.emitted == []


def test_sample_results_carry_no_emitted_flags() -> None:
    out = Sampler(seed=0)(_logits(3, 8, seed=14), [SamplingRow(_PLAIN)] * 3)
    assert out.emitted is None


# -------------------------------------------------------------------------------------------
# CUDA (marked gpu; skipped without a device)
# -------------------------------------------------------------------------------------------

_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cuda_batch(vocab: int) -> tuple[torch.Tensor, list[SamplingRow], list[list[int]]]:
    kinds = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(seed=17, top_p=0.9),
        SamplingParams(top_k=40, top_p=0.8, min_p=0.05, temperature=0.7, seed=4),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, seed=8),
        SamplingParams(logit_bias={5: 3.0, 9: -100.0}, min_tokens=4, temperature=0.0),
        SamplingParams(min_p=0.1),
    ]
    rows = [
        SamplingRow(
            kinds[i % len(kinds)],
            output_token_ids=list(range(i % 5)),
            prompt_token_ids=[3, 4, i],
            eos_token_ids=frozenset({2}),
        )
        for i in range(36)
    ]
    logits = _logits(36 * 4, vocab, seed=21, scale=2.0)
    drafts = [[int(t) for t in logits[4 * i : 4 * i + 3].argmax(dim=-1)] for i in range(36)]
    drafts = [d[: i % 4] for i, d in enumerate(drafts)]  # k = 0..3, argmax-ish drafts
    keep = [4 * i + j for i, d in enumerate(drafts) for j in range(len(d) + 1)]
    return logits[keep], rows, drafts


@pytest.mark.gpu
@_NEEDS_CUDA
@pytest.mark.parametrize("use_ops", [False, True])
def test_verify_does_not_synchronise(use_ops: bool) -> None:
    from metrale.kernels import kernels_for

    logits, rows, drafts = _cuda_batch(vocab=1000)
    ops = kernels_for(torch.device("cuda")) if use_ops else None
    sampler = Sampler(seed=0, ops=ops)
    logits = logits.to("cuda", torch.bfloat16)
    sampler.verify(logits, rows, drafts).to_host()  # warm-up (kernels compile)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sampler.verify(logits, rows, drafts)
        batch.start_copy()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = batch.to_host()
    assert len(out.token_ids) == logits.shape[0] and out.unsamplable_rows == []
    _per_row(out, drafts)


@pytest.mark.gpu
@_NEEDS_CUDA
def test_seeded_verify_agrees_across_device_types() -> None:
    logits, rows, drafts = _cuda_batch(vocab=777)
    cpu = Sampler(seed=0).verify(logits, rows, drafts).to_host()
    gpu = Sampler(seed=1).verify(logits.cuda(), rows, drafts).to_host()
    assert cpu.emitted is not None and gpu.emitted is not None
    offsets = _offsets(drafts)
    for i, row in enumerate(rows):
        if row.effective_seed is None and not row.params.is_greedy:
            continue  # unseeded: another host stream
        span = slice(offsets[i], offsets[i + 1])
        assert cpu.token_ids[span] == gpu.token_ids[span]
        assert cpu.emitted[span] == gpu.emitted[span]
    for position, token in enumerate(gpu.token_ids):
        reference = torch.log_softmax(logits[position].double(), dim=-1)
        assert gpu.logprobs[position] == pytest.approx(float(reference[token]), abs=1e-4)


def test_plain_greedy_rows_take_one_kernel_and_match_the_general_path() -> None:
    """Greedy rows with nothing processing their logits and no alternatives asked for go
    through `ops.greedy_logprobs` (one launch over every position); tokens, acceptance,
    emission, logprobs and ranks equal the general path's."""
    from metrale.kernels import kernels_for

    ops = kernels_for(torch.device("cpu"))
    logits = _logits(4 + 1 + 6, 40, seed=21)
    argmax = logits.argmax(dim=-1).tolist()
    wrong = (argmax[8] + 1) % 40
    drafts = [[argmax[0], (argmax[1] + 1) % 40, 7], [], [argmax[5], argmax[6], argmax[7], wrong, 9]]
    rows = [SamplingRow(SamplingParams(temperature=0)) for _ in drafts]
    calls: list[int] = []
    original = ops.greedy_logprobs

    def counted(x: torch.Tensor):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return original(x)

    object.__setattr__(ops, "greedy_logprobs", counted)
    fast = Sampler(ops=ops).verify(logits, rows, drafts).to_host()
    general = Sampler().verify(logits, rows, drafts).to_host()
    assert calls == [logits.shape[0]]
    assert fast.emitted == general.emitted
    assert (
        _per_row(fast, drafts)
        == _per_row(general, drafts)
        == [
            [argmax[0], argmax[1]],
            [argmax[4]],
            [argmax[5], argmax[6], argmax[7], argmax[8]],
        ]
    )
    assert fast.ranks == general.ranks
    for a, b in zip(fast.logprobs, general.logprobs, strict=True):
        assert math.isclose(a, b, abs_tol=1e-5)
    # Asking for alternatives (or a penalty) takes the general path.
    rows_lp = [SamplingRow(SamplingParams(temperature=0, logprobs=1)) for _ in drafts]
    Sampler(ops=ops).verify(logits, rows_lp, drafts)
    assert calls == [logits.shape[0]]
