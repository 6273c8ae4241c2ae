"""The L2 prefetch hint (`triton_prefetch.prefetch_l2`, `METRALE_L2_PREFETCH=1`): it changes no
tensor and no output, in a PDL chain inside a captured graph and in the engine's graphed
decode. Marked `gpu`; CUDA only (the hint is inline PTX, which the interpreter cannot run)."""

from __future__ import annotations

import pytest
import torch

from metrale import LLM, SamplingParams
from tests.helpers.checkpoints import DENSE_VARIANTS, build
from tests.helpers.parity import mixed_prompts

pytestmark = pytest.mark.gpu


def test_prefetch_keeps_stream_order_in_a_pdl_graph() -> None:
    """A kernel writes x, the prefetch launches as its dependent, the GEMV (dependent of the
    prefetch) reads x: the GEMV must see the new x on every replay."""
    from metrale.kernels import triton_gemv as tg
    from metrale.kernels import triton_prefetch as tp

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(3000, 1000, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    before = (w.clone(), other.clone())
    tp.prefetch_l2(1, [other, w], budget=8 << 20, pdl=True)  # compile outside the capture
    tp.prefetch_l2(9, [w])  # more rows than MAX_ROWS: nothing launched
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x = tg.gemv(src, w, pdl=True)  # a PDL kernel writes x
        tp.prefetch_l2(1, [other, w], pdl=True)
        y = tg.gemv(x, w, pdl=True)
    for seed in (1, 2):
        src.copy_(torch.randn(1, 4096, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, tg.gemv(tg.gemv(src, w), w), rtol=0, atol=0)
    assert torch.equal(w, before[0]) and torch.equal(other, before[1])


def test_graphed_decode_output_is_unchanged_by_the_prefetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs sm_90")
    path = str(build(next(v for v in DENSE_VARIANTS if v.name == "qwen3-qknorm")))
    prompts = mixed_prompts(6)
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=3)
    kwargs = dict(device="cuda", dtype="float32", num_kv_blocks=300, max_num_seqs=8)
    base = LLM(path, **kwargs)
    monkeypatch.setenv("METRALE_L2_PREFETCH", "1")
    hinted = LLM(path, **kwargs)
    assert hinted.engine.model.kernel_implementations["prefetch_l2"].startswith("triton")
    for batch in ([prompts[0]], prompts):  # one row (the GEMV path) and several
        for a, b in zip(base.generate(batch, params), hinted.generate(batch, params), strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs
