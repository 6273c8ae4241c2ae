"""The latency instrument's roofline bytes (`metrale.bench.offline._bytes_per_step`): the
weights a batch-1 decode step reads, the KV of the context, and on hybrid models one slot's
recurrent state read and written, counted here from the loaded tensors themselves."""

from __future__ import annotations

import pytest

from metrale import LLM
from metrale.bench.offline import _bytes_per_step
from tests.helpers.checkpoints import DENSE_VARIANTS, HYBRID_VARIANTS, Variant, build

DENSE = next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")
HYBRID = next(v for v in HYBRID_VARIANTS if v.name == "nemotronh-classic")


@pytest.mark.parametrize("variant", [DENSE, HYBRID], ids=lambda v: v.name)
def test_bytes_per_step_counts_weights_kv_and_recurrent_state(variant: Variant) -> None:
    engine = LLM(str(build(variant)), device="cpu", num_kv_blocks=40, max_num_seqs=3).engine
    model = engine.model
    weights = sum(p.numel() * p.element_size() for p in model.module.parameters())
    embed = model.module.input_embeddings().weight
    weights -= (embed.numel() - embed.shape[-1]) * embed.element_size()  # untied: one row
    attention_layers = sum(1 for k, _ in model.kv_cache.layers)
    cfg = model.config
    kv = 100 * 2 * attention_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    state = 0
    if model.ssm_pool is not None:
        state = 2 * sum(
            conv[0].numel() * conv.element_size() + ssm[0].numel() * ssm.element_size()
            for conv, ssm in model.ssm_pool.layers
        )
        assert state > 0
    parts = _bytes_per_step(engine, 100)
    assert parts["state"] == state
    assert parts["total"] == weights + kv + state
