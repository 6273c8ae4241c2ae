"""Issue 19, high-speed swap: a sequence 8x longer than its device window (its first block and
its newest blocks resident, the rest in host memory, read by attention from there) gives the
tokens of the fully resident run, on a KV pool far smaller than the sequence (and, with the
batch-invariant kernels on both sides, bit-identical logprobs: the host blocks are the device
blocks' bits); every device block and host block is returned at the end."""

from __future__ import annotations

import pytest

from metrale import LLM, SamplingParams
from metrale.errors import InvalidRequestError
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.engine_checks import assert_no_leaks

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
PROMPTS = [list(range(6, 6 + 120)), list(range(300, 300 + 90))]
PARAMS = SamplingParams(temperature=0, max_tokens=80, min_tokens=80, logprobs=2)


@pytest.mark.parametrize("invariant", [False, True])
def test_long_sequences_match_the_fully_resident_run(invariant: bool) -> None:
    path = str(build(VARIANT))
    resident = LLM(path, device="cpu", num_kv_blocks=128, block_size=8,
                   enable_prefix_caching=False, batch_invariant=invariant,
                   ).generate(PROMPTS, PARAMS)  # fmt: skip
    llm = LLM(path, device="cpu", num_kv_blocks=24, block_size=8, enable_prefix_caching=False,
              high_speed_swap=True, high_speed_swap_blocks_per_seq=2, max_prefill_chunk=16,
              batch_invariant=invariant)  # fmt: skip
    swapped = llm.generate(PROMPTS, PARAMS)
    window_tokens = (1 + 2) * 8
    assert all(len(p) + 80 >= 8 * window_tokens for p in PROMPTS[:1])  # 8x the window
    assert (len(PROMPTS[0]) + 80) // 8 > llm.engine.model.num_total_blocks()  # > the pool
    for a, b in zip(swapped, resident):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if invariant:
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
    model = llm.engine.model
    assert model.hss is not None and model.hss.stored_blocks > 40 and model.hss.held == 0
    assert_no_leaks(llm.engine)


def test_refused_where_it_is_not_built() -> None:
    path = str(build(VARIANT))
    with pytest.raises(InvalidRequestError, match="prefix caching"):
        LLM(path, device="cpu", num_kv_blocks=24, high_speed_swap=True)
    with pytest.raises(InvalidRequestError, match="recompute"):
        LLM(path, device="cpu", num_kv_blocks=24, high_speed_swap=True,
            enable_prefix_caching=False, preemption_mode="swap")  # fmt: skip
