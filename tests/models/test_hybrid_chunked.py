"""Chunked prefill on hybrid models: prefill budgets of 1, 3, 16 and 64 tokens, with chunks
running in the same forwards as other sequences' decode rows, give exactly the tokens of an
unchunked run (logprobs within 1e-4); the recurrent state after a prefill in chunks equals the
state after one whole prefill within 1e-5, and so do the next logits."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.model_engine.traits import MixedBatchResult, PrefillSlice, SequenceState
from tests.helpers.checkpoints import HYBRID_VARIANTS, Variant, build
from tests.helpers.parity import mixed_prompts

CHUNKED = [v for v in HYBRID_VARIANTS if v.name in ("nemotronh-moe", "bamba", "qwen3next")]
PARAMS = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=3)


def run(variant: Variant, chunk: int | None) -> tuple[list[list[int]], list[list[dict]], int]:
    """Tokens, logprobs and the number of forwards that mixed decode rows with prefill chunks."""
    llm = LLM(
        str(build(variant)), device="cpu", num_kv_blocks=160, max_num_seqs=8,
        max_prefill_chunk=chunk,
    )  # fmt: skip
    model = llm.engine.model
    mixed = 0
    inner = model.mixed_forward_batch

    def counting(
        decode_tokens: Sequence[int],
        decode_seqs: Sequence[SequenceState],
        prefill_streams: Sequence[PrefillSlice],
        stream: object = None,
    ) -> MixedBatchResult:
        nonlocal mixed
        mixed += bool(decode_seqs) and bool(prefill_streams)
        return inner(decode_tokens, decode_seqs, prefill_streams, stream)

    model.mixed_forward_batch = counting  # type: ignore[method-assign]
    outs = llm.generate(mixed_prompts(8)[:7], PARAMS)  # 1 to 120 tokens
    assert model.num_free_slots() == model.num_total_slots()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    return tokens, logprobs, mixed  # type: ignore[return-value]


@pytest.mark.parametrize("variant", CHUNKED, ids=lambda v: v.name)
def test_prefill_budgets_give_identical_tokens(variant: Variant) -> None:
    whole, whole_lp, _ = run(variant, None)
    for chunk in (1, 3, 16, 64):
        tokens, logprobs, mixed = run(variant, chunk)
        assert tokens == whole, f"prefill budget {chunk} changed the tokens"
        assert mixed > 0, f"budget {chunk}: no forward mixed decode rows with prefill chunks"
        for seq_a, seq_b in zip(logprobs, whole_lp, strict=True):
            for pos_a, pos_b in zip(seq_a, seq_b, strict=True):
                for tok, lp in pos_a.items():
                    assert abs(lp.logprob - pos_b[tok].logprob) <= 1e-4


@pytest.mark.parametrize("variant", CHUNKED, ids=lambda v: v.name)
def test_state_after_chunks_equals_state_after_one_prefill(variant: Variant) -> None:
    prompt = mixed_prompts(8)[7]  # 200 tokens
    llm = LLM(str(build(variant)), device="cpu", num_kv_blocks=64, max_num_seqs=2)
    model = llm.engine.model
    whole, chunked = model.alloc_sequence(), model.alloc_sequence()
    whole_logits = model.prefill(prompt, whole)
    sizes = [1, 3, 16, 64, 5, 37]  # chunk ends not aligned to the SSD (16) or delta (64) chunks
    start, i = 0, 0
    chunk_logits = None
    while start < len(prompt):
        n = min(sizes[i % len(sizes)], len(prompt) - start)
        i += 1
        last = start + n == len(prompt)
        chunk_logits = model.prefill_chunk(prompt, chunked, start, n, last)
        start += n
    assert chunk_logits is not None
    a, b = whole.ssm_slot_idx(), chunked.ssm_slot_idx()
    assert a is not None and b is not None and a != b
    for conv, ssm in model.ssm_pool.layers:
        assert (conv[a] - conv[b]).abs().max() <= 1e-5
        assert (ssm[a] - ssm[b]).abs().max() <= 1e-5
    torch.testing.assert_close(chunk_logits, whole_logits, rtol=0, atol=1e-4)
    # One decode step from each state agrees as well.
    steps = model.decode_batch([7, 7], [whole, chunked])
    torch.testing.assert_close(steps[0], steps[1], rtol=0, atol=1e-4)
    model.free_sequence(whole)
    model.free_sequence(chunked)
    assert model.num_free_slots() == 2
