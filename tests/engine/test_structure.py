"""One home per rule (issue 25): KV block counting, the token budget against `max_num_seqs`,
request validation (`Engine.check_prompt`) and the model facts the engine reads."""

from __future__ import annotations

import pytest

from metrale import Engine, EngineConfig, SamplingParams
from metrale.cache.block_pool import blocks_for
from metrale.errors import ContextLengthError, InvalidRequestError
from metrale.model_engine.traits import SequenceState, blocks_needed
from tests.helpers.checkpoints import DENSE_VARIANTS, build

VARIANT = DENSE_VARIANTS[0]


def test_blocks_for_and_blocks_needed() -> None:
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    seq = SequenceState(slot_idx=0, seq_len=5, block_table=[1, 2])
    assert blocks_needed(seq, 3, 4) == 0  # 8 tokens fit the two blocks
    assert blocks_needed(seq, 4, 4) == 1
    assert blocks_needed(seq, 0, 16) == 0  # never negative


def test_batched_tokens_below_max_num_seqs_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)
    derived = EngineConfig(max_num_seqs=4096)
    assert derived.resolved_batched_tokens("cpu") == 4096
    assert derived.resolved_batched_tokens("cuda") == 8192
    assert (
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=8).resolved_batched_tokens("cpu") == 8
    )


def test_check_prompt_validates_without_queueing() -> None:
    engine = Engine(
        EngineConfig(model=str(build(VARIANT)), device="cpu", num_kv_blocks=96, max_model_len=64)
    )
    text, ids, max_tokens = engine.check_prompt([1, 2, 3], None, SamplingParams(max_tokens=None))
    assert (text, ids, max_tokens) == (None, [1, 2, 3], 61)
    with pytest.raises(ContextLengthError):
        engine.check_prompt([1] * 64, None, SamplingParams())
    with pytest.raises(ContextLengthError):
        engine.check_prompt([1] * 10, None, SamplingParams(max_tokens=60))
    assert not engine.has_unfinished()
    model = engine.model
    assert model.max_context_len() == engine.max_model_len == 64
    assert model.device_name() == "cpu" and model.dtype_name() == "float32"
    assert set(model.forward_counters()) == {
        "graph_forwards", "eager_forwards", "cpu_projection_gemv", "cpu_projection_onednn",
        "cpu_projection_torch", "cpu_projection_gemv_unavailable", "cpu_fused_decode_forwards",
        "cpu_projection_onednn_packed",
    }  # fmt: skip
    assert model.cache_only_blocks() == 0
