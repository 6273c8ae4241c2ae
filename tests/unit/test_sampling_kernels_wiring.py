"""The sampler's kernel path (`Sampler(ops=...)`) against its torch path, on the CPU.

`ops` here is a `KernelOps` whose `argmax` / `top_k_top_p_sample` are the torch references
(`metrale.kernels.reference`), the definitions the Triton kernels are tested against; the
interpreted Triton kernels themselves run in tests/gpu/test_sampler_kernels.py. Both paths
must give the same tokens, logprobs and samplable flags: which path a batch takes depends on
its size, and a seeded row's token must not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from metrale.kernels import KernelOps, reference
from metrale.sampling import SamplingParams
from metrale.sampling.logits_processors import apply_top_p
from metrale.sampling.sampler import KERNEL_MIN_ROWS, Sampler, SamplerOutput, SamplingRow

NEG_INF = float("-inf")
#: The kernel threshold these tests build their samplers with (every batch that size or
#: larger takes the kernel: `kernel_for_full_sort_only=False`).
MIN_ROWS = 8


def _forced(ops: KernelOps, seed: int | None = None) -> Sampler:
    return Sampler(seed=seed, ops=ops, kernel_min_rows=MIN_ROWS, kernel_for_full_sort_only=False)


class _Counting:
    """A reference op that counts its calls (to prove the sampler went through `ops`)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.calls = 0
        self.rows = 0

    def __call__(self, logits: torch.Tensor, *args: object, **kwargs: object) -> object:
        self.calls += 1
        self.rows += logits.shape[0]
        return self.fn(logits, *args, **kwargs)


def _ops() -> tuple[KernelOps, _Counting, _Counting]:
    argmax = _Counting(reference.argmax)
    draw = _Counting(reference.top_k_top_p_sample)
    return KernelOps(argmax=argmax, top_k_top_p_sample=draw), argmax, draw


KINDS = [
    SamplingParams(temperature=0.0),
    SamplingParams(seed=11),
    SamplingParams(seed=12, top_k=5, temperature=0.8),
    SamplingParams(seed=13, top_p=0.7),
    SamplingParams(seed=14, min_p=0.1, temperature=1.3),
    SamplingParams(seed=15, top_k=20, top_p=0.9, min_p=0.02, temperature=0.6),
    SamplingParams(top_k=8, top_p=0.8),  # unseeded: same host stream on both paths
    SamplingParams(seed=16, top_k=-1, top_p=0.95, repetition_penalty=1.3, logprobs=3),
    SamplingParams(temperature=0.0, frequency_penalty=0.5, logit_bias={3: 4.0}),
    SamplingParams(seed=17, min_tokens=5, top_k=1000, logprobs=0),
    SamplingParams(seed=18, top_k=1),
    SamplingParams(seed=19, top_k=3, top_p=0.5),
]


def _batch(size: int, vocab: int, seed: int, ties: bool) -> tuple[torch.Tensor, list[SamplingRow]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(size, vocab, generator=g) * 2.5
    logits[:, :4] += 3.0
    if ties:
        logits = torch.round(logits * 2) / 2  # many exactly tied logits (as in bf16)
    rows = []
    for i in range(size):
        params = KINDS[(i + seed) % len(KINDS)]
        rows.append(
            SamplingRow(
                params,
                output_token_ids=[(7 * i + j) % vocab for j in range(i % 6)],
                prompt_token_ids=[1, 2, i % vocab],
                eos_token_ids=frozenset({0}),
            )
        )
    return logits, rows


def _assert_same(got: SamplerOutput, want: SamplerOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert got.ranks == want.ranks
    assert got.unsamplable_rows == want.unsamplable_rows
    assert got.top_logprobs == want.top_logprobs


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("size", [3, MIN_ROWS + 1, 40])
def test_reference_ops_give_the_torch_path_results(size: int, ties: bool) -> None:
    vocab = 300
    ops, argmax, draw = _ops()
    with_ops, without = _forced(ops, seed=4), Sampler(seed=4)
    argmax_calls = draw_calls = 0
    for step in range(6):
        logits, rows = _batch(size, vocab, seed=100 * size + step, ties=ties)
        if step == 1:  # bad rows: no finite logit, NaN, +inf, everything masked
            logits[0] = NEG_INF
            logits[1, ::2] = float("nan")
            logits[2] = float("nan")
            logits[size - 1, 7] = float("inf")
        _assert_same(with_ops(logits, rows), without(logits, rows))
        greedy = sum(row.params.is_greedy for row in rows)
        argmax_calls += greedy > 0
        draw_calls += size - greedy >= MIN_ROWS
    assert (argmax.calls, draw.calls) == (argmax_calls, draw_calls)
    assert argmax_calls > 0 and (draw_calls > 0) == (size > MIN_ROWS)


def test_the_default_sampler_takes_the_kernel_only_where_torch_would_sort_the_vocabulary() -> None:
    """KERNEL_MIN_ROWS rows or more with a top-p row lacking top-k take the kernel; smaller
    batches, and batches whose top-p rows all have top-k (or have no top-p), keep torch."""
    assert KERNEL_MIN_ROWS is not None
    n = KERNEL_MIN_ROWS
    ops, argmax, draw = _ops()
    sampler = Sampler(seed=0, ops=ops)
    logits = torch.randn(n + 4, 50, generator=torch.Generator().manual_seed(1))
    top_p = [SamplingRow(SamplingParams(seed=i, top_p=0.9)) for i in range(n + 4)]
    sampler(logits[: n - 1], top_p[: n - 1])
    assert draw.calls == 0
    sampler(logits[:n], top_p[:n])
    assert (draw.calls, draw.rows) == (1, n)
    with_k = [SamplingRow(SamplingParams(seed=i, top_p=0.9, top_k=5)) for i in range(n)]
    plain = [SamplingRow(SamplingParams(seed=i, temperature=0.7)) for i in range(n)]
    sampler(logits[:n], with_k)
    sampler(logits[:n], plain)
    assert draw.calls == 1
    # One row that torch would sort fully sends the whole batch to the kernel.
    sampler(logits[: n + 1], [*with_k, top_p[0]])
    assert (draw.calls, draw.rows) == (2, 2 * n + 1)
    sampler(logits[:2], [top_p[0], SamplingRow(SamplingParams(temperature=0.0))])
    assert (draw.calls, argmax.calls) == (2, 1)
    # An op set that labels the op "torch" (the CPU's references) keeps the torch path.
    cpu_ops = KernelOps(top_k_top_p_sample=draw, implementations={"top_k_top_p_sample": "torch"})
    Sampler(seed=0, ops=cpu_ops)(logits[:n], top_p[:n])
    assert draw.calls == 2


def test_small_batch_keeps_the_torch_draw_and_large_batch_calls_the_kernel() -> None:
    ops, argmax, draw = _ops()
    sampler = _forced(ops, seed=0)
    vocab = 50
    logits = torch.randn(MIN_ROWS, vocab, generator=torch.Generator().manual_seed(1))
    rows = [SamplingRow(SamplingParams(seed=i, top_p=0.9)) for i in range(MIN_ROWS)]
    sampler(logits[:-1], rows[:-1])
    assert (draw.calls, argmax.calls) == (0, 0)
    sampler(logits, rows)
    assert (draw.calls, draw.rows) == (1, MIN_ROWS)
    # Greedy rows beside them go through ops.argmax, the sampled ones through the kernel.
    greedy = SamplingRow(SamplingParams(temperature=0.0))
    sampler(torch.cat([logits, logits[:2]]), [*rows, greedy, greedy])
    assert (draw.calls, draw.rows) == (2, 2 * MIN_ROWS)
    assert (argmax.calls, argmax.rows) == (1, 2)


def test_seeded_row_token_does_not_depend_on_the_path() -> None:
    """The same seeded row alone (torch path) and in a large batch (kernel path)."""
    vocab, steps = 400, 30
    ops, _, draw = _ops()
    params = SamplingParams(seed=42, top_k=30, top_p=0.9, temperature=0.9)
    neighbours = [SamplingRow(SamplingParams(seed=i, min_p=0.05)) for i in range(15)]
    alone, batched = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        row_logits = torch.round(torch.randn(1, vocab, generator=g) * 6) / 2
        row = SamplingRow(params, output_token_ids=[0] * step)
        alone += Sampler(ops=ops)(row_logits, [row]).token_ids
        batch = torch.cat([torch.randn(15, vocab, generator=g), row_logits])
        batched.append(_forced(ops)(batch, [*neighbours, row]).token_ids[-1])
    assert draw.calls == steps
    assert alone == batched
    assert len(set(alone)) > 3


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("top_k", [0, 1, 5, 40])
def test_top_p_keeps_the_reference_set(top_k: int, ties: bool) -> None:
    """`apply_top_p` (full sort, or sorting only top-k candidates) keeps exactly the tokens
    `reference.top_k_top_p_filter` keeps: float64 masses, ties ranked by id, and every token
    tied with the k-th largest logit competing (more than k candidates)."""
    rows, vocab = 64, 200
    g = torch.Generator().manual_seed(top_k + 10 * ties)
    x = torch.randn(rows, vocab, generator=g) * 2.0
    if ties:
        x = torch.round(x * 2) / 2
    x[:8] = torch.round(x[:8])  # coarser: long tie runs at the top-k and top-p boundaries
    ks = torch.full((rows,), top_k, dtype=torch.int64)
    ps = torch.rand(rows, generator=g) * 0.98 + 0.01
    ps[:4] = torch.tensor([0.999, 0.5, 0.25, 0.9])
    want, _ = reference.top_k_top_p_filter(x, ks, ps)
    no_top_p, _ = reference.top_k_top_p_filter(x, ks, torch.ones(rows))
    candidates = top_k if top_k > 0 else None
    got = apply_top_p(no_top_p, ps, candidates)
    assert torch.equal(got > 0, want > 0)
    assert torch.equal(got, want)


def test_stop_masked_greedy_rows_take_the_op_with_the_torch_path_results() -> None:
    """Greedy rows under min_tokens' stop-id mask (with plain greedy rows beside them) take
    `ops.stop_masked_greedy`, one call for the batch, and get exactly the torch path's tokens,
    logprobs, ranks and samplable flags; a row that processes anything else, or wants
    alternatives, keeps the torch path."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(4, 64, generator=g) * 3
    logits[0, 2] = logits[0].max() + 1  # EOS the argmax: masked, the next one wins
    logits[2, 5] = logits[2].max() + 1  # a stop id the argmax, allowed past min_tokens
    eos = frozenset({2})
    masked = SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[5], ignore_eos=True)
    rows = [
        SamplingRow(params=masked, output_token_ids=[1, 1], eos_token_ids=eos),
        SamplingRow(params=SamplingParams(temperature=0.0), eos_token_ids=eos),
        SamplingRow(params=masked, output_token_ids=[1, 1, 1, 1], eos_token_ids=eos),
        SamplingRow(params=masked, output_token_ids=[1], eos_token_ids=eos, pending=1),
    ]
    op = _Counting(reference.stop_masked_greedy)
    kernel = Sampler(ops=KernelOps(stop_masked_greedy=op))
    got = kernel.sample(logits, rows).to_host()
    want = Sampler().sample(logits, rows).to_host()
    assert op.calls == 1 and kernel.stats == {"stop_masked_greedy_kernel": 1}
    assert got == want
    assert want.token_ids[0] != 2 and want.ranks[0] == 2 and want.token_ids[2] == 5
    for other in (
        SamplingParams(temperature=0.0, min_tokens=4, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=4, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, min_tokens=4, seed=3),
    ):
        op.calls = 0
        row = SamplingRow(params=other, output_token_ids=[1], eos_token_ids=eos)
        kernel.sample(logits[:1], [row]).to_host()
        assert op.calls == 0
