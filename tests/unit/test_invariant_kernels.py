"""Issue 24: the batch-invariant CPU kernels. Each agrees with the reference op to rounding,
and a row's result is bit-identical whatever rows share its batch and however its prompt is
chunked; through the engine, a request's logprobs are bit-identical alone, batched with
others and after a prefix-cache hit (where the reference kernels move them by ~1e-7)."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.errors import InvalidRequestError
from metrale.kernels import invariant, kernels_for, reference
from metrale.kernels.metadata import AttentionMetadata
from tests.server.helpers import tiny_checkpoint


def test_linear_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(37, 64)
    full = invariant.linear(x, w, b)
    torch.testing.assert_close(full, reference.linear(x, w, b), atol=1e-5, rtol=1e-5)
    for rows in ([5], [0, 36], list(range(3, 20)), list(range(37))[::-1]):
        part = invariant.linear(x[rows], w, b)
        assert torch.equal(part, full[rows])


def meta_for(lens: list[int], qlens: list[int], tables: torch.Tensor, nd: int) -> AttentionMetadata:
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        positions=torch.zeros(starts[-1], dtype=torch.int64),
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decode=nd,
        query_lens_host=qlens,
        seq_lens_host=lens,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        query_start_loc_host=starts,
    )


def test_attention_rows_do_not_depend_on_chunking_or_batch() -> None:
    torch.manual_seed(1)
    block, heads, kv_heads, dim, length = 4, 4, 2, 8, 19
    k_cache = torch.randn(8, block, kv_heads, dim)
    v_cache = torch.randn(8, block, kv_heads, dim)
    table = torch.tensor([[3, 1, 7, 0, 5]], dtype=torch.int32)
    q = torch.randn(length, heads, dim)
    whole = invariant.paged_attention(
        q, k_cache, v_cache, meta_for([length], [length], table, 0), 0.3
    )
    ref = reference.paged_attention(
        q, k_cache, v_cache, meta_for([length], [length], table, 0), 0.3
    )
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)
    # The last 4 rows as a later chunk, and the last row as a decode row beside another one.
    tail = invariant.paged_attention(
        q[-4:], k_cache, v_cache, meta_for([length], [4], table, 0), 0.3
    )
    assert torch.equal(tail, whole[-4:])
    other = torch.tensor([[2, 4, 6, 0, 0]], dtype=torch.int32)
    two = torch.cat([table, other])
    decode = invariant.paged_attention(
        torch.stack([q[-1], torch.randn(heads, dim)]), k_cache, v_cache,
        meta_for([length, 9], [1, 1], two, 2), 0.3,
    )  # fmt: skip
    assert torch.equal(decode[0], whole[-1])


def test_engine_logprobs_are_bit_identical_alone_batched_and_cached() -> None:
    prompts = ["def fibonacci(n):\n    # compute", "import os\nimport sys\n", "x = 1"]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    llm = LLM(str(tiny_checkpoint()), device="cpu", num_kv_blocks=128, batch_invariant=True,
              enable_prefix_caching=True, max_prefill_chunk=5)  # fmt: skip
    alone = [llm.generate([p], params)[0].outputs[0] for p in prompts]
    together = [o.outputs[0] for o in llm.generate(prompts, params)]  # prefix hits too
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # every value, bit for bit


def test_batch_invariant_is_cpu_only() -> None:
    with pytest.raises(InvalidRequestError, match="CPU"):
        kernels_for(torch.device("meta"), batch_invariant=True)
