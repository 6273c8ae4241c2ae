"""The decode graph runner's persistent buffers and padding against the plain forward: every
Triton kernel on the decode path plus the runner give the reference path's greedy tokens, and
a verify replay (Q token rows per sequence) gives the prefill path's logits.

On CUDA the runner captures real graphs (float32, so both sides round alike). Under
`METRALE_TRITON_INTERPRET=1` the same body runs uncaptured on the CPU through the interpreted
kernels, which checks the buffer, padding and null-block logic without a GPU. The verify
staging tests, which replace the graph body and need no triton, are in the default suite
(`tests/engine/test_verify_staging.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.kernels.metadata import AttentionMetadata
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.parity import mixed_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]
VARIANT = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
BS = 16


def _route_through_triton(model) -> None:  # type: ignore[no-untyped-def]
    """On the CPU, route every op through the interpreted Triton kernels."""
    from metrale.kernels.triton_ops import triton_kernel_ops

    ops = triton_kernel_ops()
    for module in model.module.modules():
        if hasattr(module, "ops"):
            module.ops = ops


def _reference_and_graphed() -> tuple[LLM, LLM]:
    """The CPU reference, and the same checkpoint (float32) whose model replays a decode
    graph runner of rungs up to 8 (captured on CUDA; its body run uncaptured through the
    interpreted kernels on the CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = LLM(str(build(VARIANT)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    llm = LLM(str(build(VARIANT)), device=device, dtype="float32", num_kv_blocks=300,
              max_num_seqs=8, enforce_eager=True, block_size=BS)  # fmt: skip
    model = llm.engine.model
    if device == "cpu":
        _route_through_triton(model)
    runner = DecodeGraphRunner(model.module, model.kv_cache.layers, model.device, 8, 32, BS)
    if device == "cuda":
        runner.capture()
    model.graph_runner = runner
    return ref, llm


def test_runner_tokens_equal_the_reference_path() -> None:
    ref, llm = _reference_and_graphed()
    model = llm.engine.model
    eager_before = model.eager_forwards  # start-up shape warm-up forwards (CUDA) count too
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    for batch in (mixed_prompts(5)[:1], mixed_prompts(5)):  # rungs 1 and 8 (5 padded)
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        want = [o.outputs[0].token_ids for o in ref.generate(batch, params)]
        assert got == want
    # The first batch is one one-token prompt: its prefill replays the decode graph; only the
    # second batch's prefill (prompts of 1 to 33 tokens) runs eagerly.
    assert model.graphed_prompt_chunks == 1
    assert model.eager_forwards - eager_before == 1, "only the multi-token prefill is eager"
    assert llm.engine.fed_steps > 0, "no replay read its input tokens on the device"


# -------------------------------------------------------------------------------------------
# Verify steps: Q token rows per sequence
# -------------------------------------------------------------------------------------------


def _tables(rows: int, blocks: int, seed: int) -> np.ndarray:
    """Distinct shuffled blocks (none is the null block 0) for each row."""
    perm = np.random.default_rng(seed).permutation(np.arange(1, 1 + rows * blocks))
    return perm.reshape(rows, blocks).astype(np.int64)


def _prefill_meta(
    query_lens: list[int], starts: list[int], tables: np.ndarray, device: torch.device
) -> AttentionMetadata:
    """Every sequence as a prefill chunk (num_decode = 0): the generic causal path."""
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    positions = np.concatenate([np.arange(s, s + q) for q, s in zip(query_lens, starts)])
    row = np.repeat(np.arange(len(query_lens)), query_lens)
    slots = tables[row, positions // BS] * BS + positions % BS
    seq_lens = [s + q for q, s in zip(query_lens, starts)]

    def up(a: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.asarray(a), dtype=dtype).to(device)

    return AttentionMetadata(
        positions=up(positions, torch.int64),
        slot_mapping=up(slots, torch.int64),
        query_start_loc=up(qsl, torch.int32),
        seq_lens=up(seq_lens, torch.int32),
        block_tables=up(tables, torch.int32),
        num_decode=0,
        query_lens_host=list(query_lens),
        seq_lens_host=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=qsl.tolist(),
    )


def test_verify_logits_equal_the_prefill_path() -> None:
    """A verify replay (Q = 3, three sequences of different lengths, one padding sequence)
    gives the logits of an eager forward of the same rows as prefill chunks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(build(VARIANT)), device=device, dtype="float32", num_kv_blocks=300,
              max_num_seqs=8, enforce_eager=True)  # fmt: skip
    model = llm.engine.model
    if device == "cpu":
        _route_through_triton(model)
    ql = 3
    runner = DecodeGraphRunner(
        model.module, model.kv_cache.layers, model.device, 8, 32, BS, query_lens=(1, ql)
    )
    if device == "cuda":
        runner.capture()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(5)
    starts = [5, 14, 30]  # 14..16 and 30..32 cross a block boundary
    tables = _tables(3, 3, 2)
    kv = model.kv_cache.layers

    def eager(tokens: np.ndarray, query_lens: list[int], at: list[int]) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.int64).to(model.device)
        meta = _prefill_meta(query_lens, at, tables, model.device)
        with torch.inference_mode():
            return model.module.compute_logits(model.module(ids, meta.positions, meta, kv))

    eager(rng.integers(3, vocab, sum(starts)), starts, [0, 0, 0])  # the cached prefixes
    drafts = rng.integers(3, vocab, (3, ql))
    got = runner.run_verify(drafts, np.array(starts), tables).float().cpu()
    assert got.shape == (3 * ql, vocab)
    want = eager(drafts.reshape(-1), [ql] * 3, starts).float().cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if device == "cuda":
        assert runner.replays == 1


def test_one_token_prompt_chunks_replay_the_decode_graph() -> None:
    """A prompt the prefix cache holds up to its last token leaves a one-token chunk: that
    forward replays the decode graph (with the decode rows beside it) and gives the tokens of
    the reference path."""
    ref, llm = _reference_and_graphed()
    model = llm.engine.model
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    prompts = [list(range(7, 7 + 2 * BS + 1)), list(range(300, 300 + 3 * BS + 1))]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert model.graphed_prompt_chunks == 0
    again = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in again] == [len(p) - 1 for p in prompts]
    assert model.graphed_prompt_chunks >= 1
    assert first == want and [o.outputs[0].token_ids for o in again] == want
