"""The sampler on a CUDA device: no host sync before `to_host()`, and agreement with the CPU.

Marked `gpu`; skipped without CUDA. The device-parametrised tests in test_sampling_sampler.py
also run their CUDA variants on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from metrale.sampling import SamplingParams
from metrale.sampling.sampler import Sampler, SamplingRow

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _mixed_rows(batch: int) -> list[SamplingRow]:
    kinds = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(seed=17, top_p=0.9),
        SamplingParams(top_k=40, top_p=0.8, min_p=0.05, temperature=0.7),
        SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(logit_bias={5: 3.0, 9: -100.0}, min_tokens=4, logprobs=0),
        SamplingParams(min_p=0.1, seed=3),
    ]
    rows = []
    for i in range(batch):
        params = kinds[i % len(kinds)]
        rows.append(
            SamplingRow(
                params,
                output_token_ids=list(range(i % 7)),
                prompt_token_ids=[3, 4, 5, i],
                eos_token_ids=frozenset({2}),
            )
        )
    return rows


def test_sample_does_not_synchronise() -> None:
    sampler = Sampler(seed=0)
    rows = _mixed_rows(48)
    logits = torch.randn(48, 1000, device="cuda", dtype=torch.bfloat16)
    sampler.sample(logits, rows)  # the first call creates the generators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = sampler.sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = batch.to_host()
    assert len(out.token_ids) == 48 and out.unsamplable_rows == []


def test_cuda_agrees_with_cpu() -> None:
    rows = _mixed_rows(60)
    logits = torch.randn(60, 777, generator=torch.Generator().manual_seed(1)) * 2
    cpu = Sampler(seed=0)(logits, rows)
    gpu = Sampler(seed=0)(logits.cuda(), rows)
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    assert [cpu.token_ids[i] for i in greedy] == [gpu.token_ids[i] for i in greedy]
    assert cpu.top_logprobs is not None and gpu.top_logprobs is not None
    for i in range(60):
        assert cpu.top_logprobs[i] == pytest.approx(gpu.top_logprobs[i], abs=1e-4)
    # Logprobs and ranks of each device's own chosen token match the CPU's raw log_softmax.
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, token in enumerate(gpu.token_ids):
        assert gpu.logprobs[i] == pytest.approx(float(reference[i, token]), abs=1e-4)
        assert gpu.ranks[i] == int((reference[i] > reference[i, token]).sum()) + 1


def test_seeded_rows_repeat_across_device_types() -> None:
    vocab = 5000
    logits = torch.randn(64, vocab, generator=torch.Generator().manual_seed(2)) * 0.5
    rows = [
        SamplingRow(SamplingParams(seed=1000 + i, top_p=0.95), output_token_ids=[0] * i)
        for i in range(64)
    ]
    cpu = Sampler(seed=0)(logits, rows).token_ids
    gpu = Sampler(seed=1)(logits.cuda(), rows).token_ids
    assert cpu == gpu
