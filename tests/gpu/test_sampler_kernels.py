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
