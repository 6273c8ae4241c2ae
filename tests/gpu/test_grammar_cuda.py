"""The grammar mask on CUDA: the same tokens as on the CPU, with no host sync in the mask.

Marked `gpu` (CUDA only). A batch of greedy and seeded rows, some constrained by a JSON
schema, sampled on CUDA and on the CPU from the same logits: identical tokens; and
`apply_grammar_masks` on CUDA runs under `torch.cuda.set_sync_debug_mode("error")`, so a
hidden device-to-host sync in the mask path fails the test.
"""

from __future__ import annotations

import pytest
import torch

from metrale.engine.intake import BUNDLED_MODEL_DIR
from metrale.sampling.grammar import GrammarBackend, apply_grammar_masks
from metrale.sampling.params import SamplingParams
from metrale.sampling.sampler import Sampler, SamplingRow
from metrale.sampling.structured import GrammarSpec
from metrale.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

SPEC = GrammarSpec.json_schema(
    {"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]}, "x"
)


def test_cuda_mask_matches_cpu_without_a_sync() -> None:
    tokenizer = Tokenizer.from_dir(BUNDLED_MODEL_DIR)
    backend = GrammarBackend(tokenizer, 8192, tokenizer.eos_token_ids)
    logits = torch.randn(6, 8192, generator=torch.Generator().manual_seed(0))
    prefix = tokenizer.encode('{"k": 1', add_special_tokens=False)

    def rows() -> list[SamplingRow]:
        out = []
        for i in range(6):
            params = SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8)
            grammar = backend.state(SPEC) if i < 4 else None
            out.append(SamplingRow(params, prefix if i < 4 else [], grammar=grammar))
        return out

    cpu = Sampler(seed=0)(logits, rows()).token_ids
    cuda = Sampler(seed=0)(logits.cuda(), rows()).token_ids
    assert cuda == cpu
    states = [backend.state(SPEC) for _ in range(4)]
    x = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masked = apply_grammar_masks(x, [0, 1, 2, 3], states, [prefix] * 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = apply_grammar_masks(
        logits, [0, 1, 2, 3], [backend.state(SPEC) for _ in range(4)], [prefix] * 4
    )
    torch.testing.assert_close(masked.cpu(), expected, rtol=0, atol=0)
