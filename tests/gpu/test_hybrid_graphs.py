"""Hybrid models (Mamba-2: Nemotron-H, Bamba; gated delta net: Qwen3-Next) decoding through the
decode graph runner, the SSM slot a graph input: greedy tokens equal the CPU float32 path's,
batches padded to a rung included (padding rows' slot -1 must leave every real slot alone),
and with the prefix cache's SSM snapshots on (multi-turn chats hit from turn 2).

On CUDA the engine captures the graphs itself (float32, graphs on: the factory must not refuse
them), its prefill through the Triton varlen kernels. Under `METRALE_TRITON_INTERPRET=1` the
runner's body runs uncaptured on the CPU through the interpreted decode kernels, checking the
slot staging and padding without a GPU.

The variants have no MoE layers: the reference grouped-expert op reads expert counts on the
host, so graphs stay off for MoE hybrids until a capturable MoE op lands (the factory logs it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.model_engine.cuda_graphs import DecodeGraphRunner
from tests.helpers.checkpoints import _LINEAR, HYBRID_VARIANTS, Variant, build
from tests.helpers.parity import mixed_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.interpretable]

CUDA = torch.cuda.is_available()
#: Qwen3-Next with dense MLPs only (see the module docstring).
QWEN3NEXT_DENSE = Variant(
    "qwen3next-dense", "qwen3_next",
    tuple(dict(num_hidden_layers=4, head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0, 1, 2, 3], **_LINEAR).items()),
)  # fmt: skip
#: Nemotron-H (Mamba-2, attention, MLP), Bamba, and the dense Qwen3-Next.
VARIANTS = [
    next(v for v in HYBRID_VARIANTS if v.name == "nemotronh-classic"),
    next(v for v in HYBRID_VARIANTS if v.name == "bamba"),
    QWEN3NEXT_DENSE,
]
BS = 16
PARAMS = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)


def _graphed(variant: Variant) -> tuple[LLM, DecodeGraphRunner]:
    """The engine under test and its runner: on CUDA the factory's own (graphs on); on the CPU
    a runner without graphs whose body calls the interpreted Triton kernels."""
    path = str(build(variant))
    if CUDA:
        # The CPU's snapshot gap (2 blocks), so both plan the same capture points.
        llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=300, max_num_seqs=8,
                  ssm_snapshot_min_gap_tokens=32)  # fmt: skip
        runner = llm.engine.model.graph_runner
        assert runner is not None, "the factory refused graphs for a hybrid model"
        assert runner.ssm_layers is not None and runner.graphs
        return llm, runner
    from metrale.kernels import ssm_reference
    from metrale.kernels.triton_ops import triton_kernel_ops

    llm = LLM(path, device="cpu", num_kv_blocks=300, max_num_seqs=8, enforce_eager=True)
    model = llm.engine.model
    # Interpreted prefill scans walk every prompt token in Python: prefill keeps the torch
    # references here (the kernels have their own tests); the decode ops under test are Triton.
    ops = dataclasses.replace(
        triton_kernel_ops(),
        causal_conv1d_varlen=ssm_reference.causal_conv1d_varlen,
        mamba2_chunk_scan_varlen=ssm_reference.mamba2_chunk_scan_varlen,
        gated_delta_chunk_varlen=ssm_reference.gated_delta_chunk_varlen,
    )
    for module in model.module.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    assert model.ssm_pool is not None
    runner = DecodeGraphRunner(
        model.module, model.main_kv_layers, model.device, 8, 32, BS,
        ssm_layers=model.ssm_pool.layers,
    )  # fmt: skip
    model.graph_runner = runner
    return llm, runner


def _counting(runner: DecodeGraphRunner) -> list[int]:
    """Count the runner's decode replays (the uncaptured runner has no `replays` of its own)."""
    calls = [0]
    run = runner.run

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return run(*args, **kwargs)

    runner.run = counted  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_graphed_hybrid_decode_equals_cpu_float32(variant: Variant) -> None:
    ref = LLM(str(build(variant)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    llm, runner = _graphed(variant)
    calls = _counting(runner)
    for batch in (mixed_prompts(5)[:1], mixed_prompts(5)):  # rungs 1 and 8 (5 padded)
        got = [o.outputs[0].token_ids for o in llm.generate(batch, PARAMS)]
        want = [o.outputs[0].token_ids for o in ref.generate(batch, PARAMS)]
        assert got == want
    # 7 decode steps of each batch after its prefill, all through the runner.
    assert calls[0] >= 14


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_graphed_hybrid_chat_with_ssm_snapshots_equals_cpu(variant: Variant) -> None:
    """Issue 15's path under graphs: turn 2+ restores a snapshot (cached tokens > 0) and still
    gives the CPU float32 tokens; the decode steps between run through the runner."""
    ref = LLM(str(build(variant)), device="cpu", num_kv_blocks=300, max_num_seqs=8)
    llm, runner = _graphed(variant)
    calls = _counting(runner)
    chat: list[dict[str, str]] = [{"role": "system", "content": "Be brief and exact. " * 6}]
    for turn, question in enumerate(["def add(a, b):", "import os", "class Foo:"]):
        chat.append({"role": "user", "content": question})
        got = llm.chat(chat, PARAMS)[0]
        want = ref.chat(chat, PARAMS)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        if turn:
            assert got.num_cached_tokens > 0
        chat.append({"role": "assistant", "content": want.outputs[0].text})
    assert calls[0] >= 3 * 7
