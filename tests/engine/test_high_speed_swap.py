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


def test_staging_gathers_each_sequence_in_table_order() -> None:
    """The CUDA path's per-layer gather (`HssStaging`), run on the CPU: the scratch cache read
    through the staging's tables holds exactly the blocks the reference reads through the
    original tables (device and host entries), and consecutive host blocks go in one copy."""
    import torch

    from metrale.cache.hss import HostKvPool, host_entry
    from metrale.cache.kv_cache import PagedKVCache
    from metrale.kernels.metadata import AttentionMetadata
    from metrale.kernels.reference import _gather

    kv = PagedKVCache(2, 12, 4, 2, 8, torch.float32, torch.device("cpu"))
    for k, v in kv.layers:
        k.normal_()
        v.normal_()
    pool = HostKvPool(kv, initial_blocks=2)  # grows while storing
    hosted = {b: pool.store(b) for b in (2, 3, 4, 7)}
    tables = [
        [1, host_entry(hosted[2]), host_entry(hosted[3]), host_entry(hosted[4]), 5],
        [6, host_entry(hosted[7]), 8],
    ]
    seq_lens = [18, 10]  # 5 and 3 blocks of 4
    staging = pool.staging(tables, seq_lens, torch.device("cpu"))
    assert [n for _, _, n in staging.host_runs] == [3, 1]
    meta = AttentionMetadata(
        positions=torch.zeros(2, dtype=torch.long), slot_mapping=torch.zeros(2, dtype=torch.long),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (5 - len(t)) for t in tables], dtype=torch.int32),
        num_decode=2, query_lens_host=[1, 1], seq_lens_host=seq_lens, max_query_len=1,
        max_seq_len=18, host_kv=staging,
    )  # fmt: skip
    for k_cache, v_cache in kv.layers:
        host_k, host_v = pool.layer_tensors(k_cache)
        sk, sv, smeta = staging.stage(k_cache, v_cache, meta)
        assert smeta.host_kv is None and smeta.num_decode == 2
        for b, n in enumerate(seq_lens):
            for cache, scratch, host in ((k_cache, sk, host_k), (v_cache, sv, host_v)):
                want = _gather(cache, meta.block_tables[b], n, host)
                assert torch.equal(_gather(scratch, smeta.block_tables[b], n), want)
