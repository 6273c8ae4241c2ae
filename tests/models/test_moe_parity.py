"""Mixture-of-experts architectures against transformers: greedy tokens identical and logprobs
within 1e-4, float32 on the CPU, for a batch of 8 prompts of 1 to 200 tokens (Qwen3-MoE with
and without `norm_topk_prob` and with a dense layer, Mixtral; both config layouts). Experts
load from per-expert tensors and from transformers 5's fused tensors alike, and the grouped
expert op equals a per-token loop."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from metrale.kernels.ssm_reference import moe_experts
from tests.helpers.checkpoints import MOE_VARIANTS, Variant, build, load_hf
from tests.helpers.parity import assert_matches, hf_greedy, mixed_prompts

NEW_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=5)


@pytest.mark.parametrize("variant", MOE_VARIANTS, ids=lambda v: v.name)
def test_greedy_matches_transformers(variant: Variant) -> None:
    path = build(variant)
    prompts = mixed_prompts(8)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=160)
    outs = llm.generate(prompts, PARAMS)
    hf = load_hf(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out, hf_greedy(hf, prompt, NEW_TOKENS))


def _fuse_experts(src: Path, dst: Path, num_experts: int) -> None:
    """Rewrite a checkpoint's per-expert tensors into transformers 5's in-memory layout
    (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    layers = sorted({k.split(".experts.")[0] for k in tensors if ".experts." in k})
    for name, t in tensors.items():
        if ".experts." not in name:
            out[name] = t
    for prefix in layers:
        gate = [tensors[f"{prefix}.experts.{e}.gate_proj.weight"] for e in range(num_experts)]
        up = [tensors[f"{prefix}.experts.{e}.up_proj.weight"] for e in range(num_experts)]
        down = [tensors[f"{prefix}.experts.{e}.down_proj.weight"] for e in range(num_experts)]
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)]
        ).contiguous()
        out[f"{prefix}.experts.down_proj"] = torch.stack(down).contiguous()
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path: Path) -> None:
    variant = MOE_VARIANTS[0]
    path = build(variant)
    experts = json.loads((path / "config.json").read_text())["num_local_experts"]
    _fuse_experts(path, tmp_path, experts)
    prompts = mixed_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    per_expert = LLM(str(path), device="cpu", num_kv_blocks=64).generate(prompts, params)
    fused = LLM(str(tmp_path), device="cpu", num_kv_blocks=64).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in per_expert]


@pytest.mark.parametrize("gated", [True, False])
def test_grouped_experts_equal_a_per_token_loop(gated: bool) -> None:
    g = torch.Generator().manual_seed(3)
    tokens, hidden, inter, experts, k = 37, 16, 8, 6, 2
    x = torch.randn(tokens, hidden, generator=g)
    w_in = torch.randn(experts, (2 if gated else 1) * inter, hidden, generator=g)
    w_out = torch.randn(experts, hidden, inter, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    act = "silu" if gated else "relu2"
    out = moe_experts(x, w_in, w_out, ids, weights, gated, act)
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(k):
            e = int(ids[t, j])
            h = w_in[e] @ x[t]
            if gated:
                gate, up = h.chunk(2)
                h = torch.nn.functional.silu(gate) * up
            else:
                h = torch.relu(h) ** 2
            expected[t] += weights[t, j] * (w_out[e] @ h)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
