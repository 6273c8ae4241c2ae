"""Logits processors against hand-computed values; inputs are never modified."""

from __future__ import annotations

import torch

from metrale.sampling.logits_processors import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_min_p,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    mask_tokens,
    token_counts,
)

NEG_INF = float("-inf")


def _t(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = _t([[2.0, -1.0, 0.0, 3.0], [4.0, -2.0, 1.0, NEG_INF]])
    before = logits.clone()
    mask = torch.tensor([[True, True, True, False], [True, True, False, True]])
    out = apply_repetition_penalty(logits, mask, torch.tensor([2.0, 0.5]))
    expected = _t([[1.0, -2.0, 0.0, 3.0], [8.0, -1.0, 1.0, NEG_INF]])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(logits, before)
    # A float penalty applies to every row; 1.0 is the identity.
    torch.testing.assert_close(
        apply_repetition_penalty(logits, mask, 4.0)[0], _t([[0.5, -4.0, 0.0, 3.0]])[0]
    )
    assert torch.equal(apply_repetition_penalty(logits, mask, 1.0), logits)


def test_frequency_presence_openai_rule() -> None:
    logits = _t([[1.0, 1.0, 1.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    counts = torch.tensor([[0, 1, 3, 2], [2, 0, 1, 0]])
    out = apply_frequency_presence(
        logits, counts, torch.tensor([0.5, -1.0]), torch.tensor([0.25, 2.0])
    )
    # logit - (count * freq + (count > 0) * pres)
    expected = _t(
        [
            [1.0, 1.0 - 0.5 - 0.25, 1.0 - 1.5 - 0.25, -1.0 - 1.0 - 0.25],
            [0.0 + 2.0 - 2.0, 0.0, 0.0 + 1.0 - 2.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)
    assert torch.equal(apply_frequency_presence(logits, counts, 0.0, 0.0), logits)


def test_logit_bias_is_sparse_add() -> None:
    logits = _t([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    before = logits.clone()
    out = apply_logit_bias(
        logits, torch.tensor([0, 1, 1]), torch.tensor([2, 0, 2]), torch.tensor([10.0, -100.0, 0.5])
    )
    torch.testing.assert_close(out, _t([[0.0, 1.0, 12.0], [-97.0, 4.0, 5.5]]), rtol=0, atol=0)
    assert torch.equal(logits, before)


def test_mask_tokens() -> None:
    logits = _t([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    out = mask_tokens(logits, torch.tensor([0, 1]), torch.tensor([1, 1]))
    torch.testing.assert_close(out, _t([[0.0, NEG_INF, 2.0], [3.0, NEG_INF, 5.0]]), rtol=0, atol=0)
    assert logits[0, 1] == 1.0


def test_token_counts_ignores_out_of_range_ids() -> None:
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    tokens = torch.tensor([2, 2, 0, 3, 4, -1])  # 4 and -1 are outside a vocab of 4
    counts = token_counts(rows, tokens, 2, 4, torch.float32)
    torch.testing.assert_close(counts, _t([[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 1.0]]))


def test_top_k_keeps_k_largest_per_row() -> None:
    logits = _t([[1.0, 5.0, 3.0, 4.0, 2.0], [1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    out = apply_top_k(logits, torch.tensor([2, 5, 1]), max_k=5)
    expected = _t(
        [
            [NEG_INF, 5.0, NEG_INF, 4.0, NEG_INF],
            [1.0, 5.0, 3.0, 4.0, 2.0],
            [NEG_INF, NEG_INF, 1.0, NEG_INF, NEG_INF],
        ]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_min_p_relative_to_top_probability() -> None:
    probs = _t([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    out = apply_min_p(probs, torch.tensor([0.35, 1.0]))
    # Row 0 threshold 0.175: 0.5 and 0.3 stay. Row 1: all equal the top, all stay.
    torch.testing.assert_close(out, _t([[0.5, 0.3, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]))


def test_top_p_smallest_nucleus_reaching_p() -> None:
    probs = _t([[0.15, 0.5, 0.05, 0.3]] * 4)
    out = apply_top_p(probs, torch.tensor([0.45, 0.6, 0.9, 1.0]))
    expected = _t(
        [
            [0.0, 0.5, 0.0, 0.0],  # the top token alone reaches 0.45
            [0.0, 0.5, 0.0, 0.3],
            [0.15, 0.5, 0.0, 0.3],
            [0.15, 0.5, 0.05, 0.3],
        ]
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # Unnormalised input: the nucleus is relative to the row's mass (4.0 here).
    torch.testing.assert_close(
        apply_top_p(_t([[2.0, 1.0, 0.6, 0.4]]), 0.6), _t([[2.0, 1.0, 0.0, 0.0]])
    )
    # A tiny top_p keeps the top token.
    torch.testing.assert_close(apply_top_p(probs[:1], 1e-9), _t([[0.0, 0.5, 0.0, 0.0]]))


def test_top_p_with_candidate_bound_matches_full_sort() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 40, generator=generator) * 2
    k = torch.randint(1, 12, (16,), generator=generator)
    probs = torch.softmax(apply_top_k(logits, k, int(k.max())), dim=-1)
    p = torch.rand(16, generator=generator) * 0.9 + 0.05
    torch.testing.assert_close(
        apply_top_p(probs, p, max_candidates=int(k.max())), apply_top_p(probs, p), rtol=0, atol=0
    )
