"""The sampler with the real Triton sampling kernels (`ops=`) against its torch path.

Marked `gpu`: runs on a CUDA device, or on the CPU under Triton's interpreter with
`METRALE_TRITON_INTERPRET=1` (small vocabulary). The torch path runs on the same device; the
seeded rows must draw the same tokens through either path (tests/unit/
test_sampling_kernels_wiring.py checks the wiring with the torch references as `ops`).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from metrale.kernels import KernelOps
from metrale.kernels import triton_sampling as ts
from metrale.sampling import SamplingParams
from metrale.sampling.sampler import Sampler, SamplingRow

INTERPRET = os.environ.get("METRALE_TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

KINDS = [
    SamplingParams(seed=1),
    SamplingParams(seed=2, top_k=20, temperature=0.7),
    SamplingParams(seed=3, top_p=0.8),
    SamplingParams(seed=4, min_p=0.05, top_p=0.9, temperature=1.2),
    SamplingParams(seed=5, top_k=40, top_p=0.6, min_p=0.01),
    SamplingParams(seed=6, top_k=1),
    SamplingParams(temperature=0.0),
    SamplingParams(seed=7, repetition_penalty=1.2, logit_bias={5: 2.0}, top_k=5),
]


@pytest.mark.parametrize("ties", [False, True])
def test_sampler_with_triton_ops_draws_the_torch_path_tokens(ties: bool) -> None:
    vocab = 600 if INTERPRET else 151_936
    size = 12 if INTERPRET else 64
    steps = 2 if INTERPRET else 6
    ops = KernelOps(argmax=ts.argmax, top_k_top_p_sample=ts.top_k_top_p_sample)
    g = torch.Generator().manual_seed(5 + ties)
    for step in range(steps):
        logits = torch.randn(size, vocab, generator=g) * 2.0
        logits[:, :3] += 4.0
        if ties:
            logits = torch.round(logits * 2) / 2  # many exactly tied logits (as in bf16)
        logits[0, 5:] = float("-inf")  # few finite logits
        logits[1] = float("-inf")  # unsamplable
        rows = [
            SamplingRow(KINDS[i % len(KINDS)], output_token_ids=[0] * (step + i % 3))
            for i in range(size)
        ]
        kernel = Sampler(ops=ops, kernel_min_rows=1, kernel_for_full_sort_only=False)(
            logits.to(DEVICE), rows
        )
        torch_path = Sampler()(logits.to(DEVICE), rows)
        assert kernel.token_ids == torch_path.token_ids
        assert kernel.unsamplable_rows == torch_path.unsamplable_rows == [1]
        assert kernel.logprobs == torch_path.logprobs


def _hard_logits(g: torch.Generator, size: int, vocab: int) -> torch.Tensor:
    logits = torch.round(torch.randn(size, vocab, generator=g) * 8) / 4  # exact ties
    logits[0, 5:] = float("-inf")  # few finite logits
    logits[1] = float("-inf")  # unsamplable
    logits[2, 9] = float("nan")
    logits[3, 17] = float("inf")
    logits[4] = 0.5  # every logit tied
    return logits


@pytest.mark.parametrize("with_min_p", [True, False])
def test_full_row_kernel_tempers_on_the_fly_and_skips_inactive_rows(with_min_p: bool) -> None:
    """The one-launch kernel (`triton_full_row_draw`, taken when `active=` is given):
    `temperature=` divides as torch does before the filters; `active=` leaves rows out."""
    from metrale.kernels import reference

    vocab = 600 if INTERPRET else 151_936
    size = 16 if INTERPRET else 48
    g = torch.Generator().manual_seed(31 + with_min_p)
    logits = _hard_logits(g, size, vocab)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.8, 2.0, 0.5, 1.1, 0.9] * (size // 8))
    top_k = torch.tensor([5, 50, 1, 20, 7, 300, 2, 40] * (size // 8))
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.8, 0.3, 1.0, 0.7] * (size // 8))
    min_p = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.0, 0.02] * (size // 8))
    uniforms = torch.rand(size, generator=g, dtype=torch.float64)
    active = torch.arange(size) % 3 != 1
    args = [t.to(DEVICE) for t in (logits, top_k, top_p, uniforms)]
    floor = min_p if with_min_p else None
    ids, ok = ts.top_k_top_p_sample(
        *args,
        None if floor is None else floor.to(DEVICE),
        temperature=temperature.to(DEVICE),
        active=active.to(DEVICE),
    )
    ref_ids, ref_ok = reference.top_k_top_p_sample(
        *[t.cpu() for t in args], floor, temperature=temperature, active=active
    )
    assert ids.cpu().tolist() == ref_ids.tolist()
    assert ok.cpu().tolist() == ref_ok.tolist()
    assert not ok.cpu()[~active].any() and (ids.cpu()[~active] == 0).all()


def test_token_logprobs_kernel_matches_the_reference() -> None:
    from metrale.kernels import reference

    vocab = 600 if INTERPRET else 151_936
    g = torch.Generator().manual_seed(32)
    logits = _hard_logits(g, 8, vocab)
    tokens = torch.tensor([0, 3, 9, 17, 100, 5, 599, 42])
    samplable = torch.tensor([True, False, True, True, True, False, True, True])
    ids, packed = ts.token_logprobs(logits.to(DEVICE), tokens.to(DEVICE), samplable.to(DEVICE))
    ref_ids, ref_packed = reference.token_logprobs(logits, tokens, samplable)
    assert ids.cpu().tolist() == ref_ids.tolist()
    packed = packed.cpu()
    assert packed[:, [0, 2, 3]].tolist() == ref_packed[:, [0, 2, 3]].tolist()
    torch.testing.assert_close(packed[:, 1], ref_packed[:, 1], rtol=0, atol=1e-5)


def test_bitmask_kernels_match_the_references() -> None:
    """`masked_argmax` and `apply_token_bitmask` (a grammar's int32 token bitmask read beside
    the logits) against the torch references: NaN, +inf, ties, a row with nothing allowed,
    a row with everything allowed, bit 31 of the words; all rows and a subset of rows."""
    from metrale.kernels import reference

    vocab = 600 if INTERPRET else 151_936
    g = torch.Generator().manual_seed(34)
    logits = _hard_logits(g, 8, vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31, (8, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[5] = 0
    bitmask[6] = -1
    bitmask[7] = -(2**31)  # only bit 31 of each word: tokens 31, 63, ...
    ids, values = ts.masked_argmax(logits.to(DEVICE), bitmask.to(DEVICE))
    ref_ids, ref_values = reference.masked_argmax(logits, bitmask)
    assert ids.cpu().tolist() == ref_ids.tolist()
    assert values.cpu().tolist() == ref_values.tolist()
    assert ref_ids[7] % 32 == 31 and ref_values[5] == float("-inf")
    out = ts.apply_token_bitmask(logits.to(DEVICE), bitmask.to(DEVICE))
    torch.testing.assert_close(
        out.cpu(), reference.apply_token_bitmask(logits, bitmask), rtol=0, atol=0, equal_nan=True
    )
    rows = torch.tensor([6, 2, 7])
    out = ts.apply_token_bitmask(logits.to(DEVICE), bitmask[:3].to(DEVICE), rows.to(DEVICE))
    expected = reference.apply_token_bitmask(logits, bitmask[:3], rows)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0, equal_nan=True)


def test_candidate_draw_with_triton_ops_draws_the_torch_path_tokens() -> None:
    """The candidate draw on the device (`candidate_sample`), its re-routed rows through the
    one-launch full-row kernel, the result through `token_logprobs`: the same tokens as the
    full-row torch path."""
    vocab = 600 if INTERPRET else 151_936
    size = 8 if INTERPRET else 64
    ops = KernelOps(
        top_k_top_p_sample=ts.top_k_top_p_sample,
        candidate_sample=ts.candidate_sample,
        token_logprobs=ts.token_logprobs,
        implementations={"top_k_top_p_sample": "triton", "token_logprobs": "triton"},
    )
    g = torch.Generator().manual_seed(33)
    kinds = [
        SamplingParams(seed=1, top_k=50, top_p=0.95, temperature=0.8),
        SamplingParams(seed=2, top_k=20, temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=3, top_k=5, min_p=0.05, temperature=1.2),
        SamplingParams(seed=4, top_k=40, top_p=0.6, repetition_penalty=1.2),
    ]
    for step in range(2):
        logits = _hard_logits(g, size, vocab).to(DEVICE)
        rows = [
            SamplingRow(kinds[i % len(kinds)], output_token_ids=[3, 5] * (step + i % 3))
            for i in range(size)
        ]
        sampler = Sampler(ops=ops)
        fast = sampler(logits, rows)
        full = Sampler(candidate_k_max=None)(logits, rows)
        assert fast.token_ids == full.token_ids
        assert fast.unsamplable_rows == full.unsamplable_rows
        assert fast.ranks == full.ranks
        torch.testing.assert_close(
            torch.tensor(fast.logprobs), torch.tensor(full.logprobs), rtol=0, atol=1e-4
        )
        assert {2, 4} <= set(fast.rerouted_rows)
        assert sampler.stats["candidates"] == 1


@pytest.mark.skipif(INTERPRET, reason="CUDA only: synchronisation and device agreement")
def test_candidate_draw_does_not_synchronise_and_repeats_the_cpu_tokens() -> None:
    from metrale.kernels.triton_ops import triton_kernel_ops

    vocab = 151_936
    g = torch.Generator().manual_seed(34)
    logits = _hard_logits(g, 32, vocab)
    rows = [
        SamplingRow(SamplingParams(seed=100 + i, top_k=50, top_p=0.95, temperature=0.8))
        for i in range(32)
    ]
    rows[7] = SamplingRow(SamplingParams(temperature=0.0))
    sampler = Sampler(ops=triton_kernel_ops())
    device_logits = logits.cuda()
    sampler.sample(device_logits, rows).to_host()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sampler.sample(device_logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gpu = batch.to_host()
    cpu = Sampler()(logits, rows)
    assert gpu.token_ids == cpu.token_ids
    assert gpu.unsamplable_rows == cpu.unsamplable_rows == [1]
    assert {2, 4} <= set(gpu.rerouted_rows)
    assert sampler.stats["candidates"] == 2


@pytest.mark.parametrize("width", [64, 100] if INTERPRET else [64, 128, 256, 100])
def test_candidate_kernel_matches_the_reference(width: int) -> None:
    """`candidate_sample` (one program per row, sorts of packed keys) against the torch
    reference on `torch.topk` candidates: ties, NaN, +inf, -inf rows, greedy riders."""
    from metrale.kernels import reference
    from metrale.sampling.candidates import pack_rows

    vocab = 100 if width == 100 else 600  # 100: the candidates are the whole vocabulary
    size = 10 if INTERPRET else 64
    g = torch.Generator().manual_seed(40 + width)
    logits = _hard_logits(g, size, vocab)
    params = [
        SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
            top_k=[1, 5, 20, 32, 50][i % 5],
            top_p=[1.0, 0.9, 0.5][i % 3],
            min_p=[0.0, 0.05][i % 2],
        )
        for i in range(size)
    ]
    uniforms = torch.rand(size, generator=g, dtype=torch.float64).tolist()
    table = pack_rows(params, uniforms, torch.device("cpu"))
    values, ids = logits.topk(width, dim=-1)
    for has_top_p, has_min_p in [(True, True), (False, False)]:
        got = ts.candidate_sample(
            values.to(DEVICE), ids.to(DEVICE), table.to(DEVICE), vocab,
            has_top_p=has_top_p, has_min_p=has_min_p,
        )  # fmt: skip
        want = reference.candidate_sample(
            values, ids, table, vocab, has_top_p=has_top_p, has_min_p=has_min_p
        )
        got_ids, got_ok, got_rerouted = (t.cpu() for t in got)
        want_ids, want_ok, want_rerouted = want
        assert got_rerouted.tolist() == want_rerouted.tolist()
        assert got_ok.tolist() == want_ok.tolist()
        valid = want_ok & ~want_rerouted
        assert got_ids[valid].tolist() == want_ids[valid].tolist()
        if width < vocab:
            assert want_rerouted[2] and want_rerouted[4]  # NaN; every logit tied


@pytest.mark.parametrize("width", [16] if INTERPRET else [64, 128])
def test_row_topk_matches_torch_topk(width: int) -> None:
    """`row_topk` (chunk maxima, threshold, compaction, sort) against `torch.topk`: the same
    values in the same order, ids that hold them, one id each; ties (bf16-valued logits), a
    NaN row and a +inf row; a row mostly -inf overflows its buffer and is marked NaN."""
    from metrale.kernels.triton_row_topk import row_topk, usable

    vocab = 16_384 + 7 if INTERPRET else 151_936
    rows = 6 if INTERPRET else 48
    assert usable(vocab, width)
    g = torch.Generator().manual_seed(41)
    x = torch.randn(rows, vocab, generator=g) * 2.5
    x[1::2] = x[1::2].bfloat16().float()  # ties, as a bf16 model's logits
    x[2, 77] = float("nan")
    x[3, 1234] = float("inf")
    x[4] = float("-inf")  # buffer overflow: every value ties at the threshold
    x[4, 10:13] = 1.0
    x[5, : vocab // 2] = -0.0
    values, ids = row_topk(x.to(DEVICE), width)
    values, ids = values.cpu(), ids.cpu()
    want, _ = x.topk(width, dim=-1, sorted=True)
    for r in range(rows):
        if r == 4:
            assert torch.isnan(values[r, 0])
            continue
        assert torch.equal(values[r], want[r]) or torch.allclose(values[r], want[r], equal_nan=True)
        assert len(set(ids[r].tolist())) == width
        got = x[r, ids[r]]
        assert torch.allclose(got, values[r], equal_nan=True)
