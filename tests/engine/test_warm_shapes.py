"""`warm_forward_shapes` (run at CUDA start-up) leaves the model exactly as it found it: every
block back in the pool, and the next request's tokens unchanged."""

from __future__ import annotations

from metrale import LLM, SamplingParams
from metrale.model_engine.gpu_setup import warm_forward_shapes

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:"]


def test_warm_up_frees_everything_and_changes_no_output() -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    llm = LLM(device="cpu", enable_prefix_caching=False, num_kv_blocks=512)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    model = llm.engine.model
    free = model.num_free_blocks()
    assert warm_forward_shapes(model, max_num_seqs=8) > 0
    assert model.num_free_blocks() == free
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert after == before
