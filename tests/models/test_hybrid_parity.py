"""Hybrid architectures against transformers: greedy tokens identical and logprobs within 1e-4,
float32 on the CPU, for a batch of 8 prompts of 1 to 200 tokens: Nemotron-H (Mamba-2, NoPE
attention, MLP and sigmoid-routed MoE blocks; pattern-string and block-list configs), Bamba,
and Qwen3-Next (gated delta net, gated attention, MoE with shared expert; layer-type list and
interval configs). Every SSM slot and KV block is free afterwards. Also: the state each
recurrent layer keeps after a prefill equals transformers' cache (same conv layout), and MTP
weights load when present."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from tests.helpers.checkpoints import HYBRID_VARIANTS, Variant, build, load_hf
from tests.helpers.parity import assert_matches, hf_greedy, mixed_prompts

NEW_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=5)


def variant(name: str) -> Variant:
    return next(v for v in HYBRID_VARIANTS if v.name == name)


@pytest.mark.parametrize("variant", HYBRID_VARIANTS, ids=lambda v: v.name)
def test_greedy_matches_transformers(variant: Variant) -> None:
    path = build(variant)
    prompts = mixed_prompts(8)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=160, max_num_seqs=8)
    model = llm.engine.model
    assert model.has_ssm_layers()
    outs = llm.generate(prompts, PARAMS)
    hf = load_hf(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out, hf_greedy(hf, prompt, NEW_TOKENS))
    assert model.num_free_slots() == model.num_total_slots() == 8
    # Only the prefix cache (with its SSM snapshots) holds blocks now.
    assert model.num_free_blocks() + model.cache_only_blocks() == model.num_total_blocks()


def _hf_states(hf: torch.nn.Module, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' (conv, recurrent) state of each recurrent layer after prefilling
    `prompt`, in layer order."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    cache = out.cache
    states = []
    for layer in cache.layers:
        if getattr(layer, "conv_states", None) is None:
            continue  # an attention layer
        # Per layer one state of each kind (index 0), batch row 0.
        states.append((layer.conv_states[0][0], layer.recurrent_states[0][0]))
    return states


@pytest.mark.parametrize("name", ["nemotronh-moe", "bamba", "qwen3next"])
def test_prefill_state_equals_transformers_cache(name: str) -> None:
    path = build(variant(name))
    prompt = mixed_prompts(8)[6]  # 120 tokens: several SSD chunks, two delta-rule chunks
    llm = LLM(str(path), device="cpu", num_kv_blocks=64, max_num_seqs=2)
    model = llm.engine.model
    seq = model.alloc_sequence()
    model.prefill(prompt, seq)
    slot = seq.ssm_slot_idx()
    assert slot is not None
    ours = [(conv[slot], ssm[slot]) for conv, ssm in model.ssm_pool.layers]
    theirs = _hf_states(load_hf(path), prompt)
    assert len(ours) == len(theirs) > 0
    for (conv, ssm), (hf_conv, hf_ssm) in zip(ours, theirs, strict=True):
        assert conv.shape == hf_conv.shape and ssm.shape == hf_ssm.shape
        assert ssm.dtype == torch.float32
        torch.testing.assert_close(conv, hf_conv, rtol=0, atol=1e-5)
        torch.testing.assert_close(ssm, hf_ssm.float(), rtol=0, atol=1e-5)
    model.free_sequence(seq)
    assert model.num_free_slots() == 2


def test_qwen3_next_mtp_weights_load_when_present_and_are_dropped_when_absent(
    tmp_path: Path,
) -> None:
    path = build(variant("qwen3next"))
    plain = LLM(str(path), device="cpu", num_kv_blocks=32, max_num_seqs=2)
    assert not plain.engine.model.module.has_mtp  # the checkpoint has no mtp.* tensors

    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(path / "model.safetensors"))
    # An MTP layer is a full-attention decoder layer: reuse layer 3's tensors, perturbed.
    g = torch.Generator().manual_seed(0)
    extra = {
        "mtp." + k.removeprefix("model.").replace("layers.3.", "layers.0."): t
        + 0.01 * torch.randn(t.shape, generator=g)
        for k, t in tensors.items()
        if k.startswith("model.layers.3.")
    }
    hidden = cfg["hidden_size"]
    extra["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=g)
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    llm = LLM(str(tmp_path), device="cpu", num_kv_blocks=32, max_num_seqs=2)
    module = llm.engine.model.module
    assert module.has_mtp
    params = dict(module.named_parameters())
    torch.testing.assert_close(params["mtp.fc.weight"], extra["mtp.fc.weight"])
    torch.testing.assert_close(
        params["mtp.layers.0.self_attn.o_proj.weight"],
        extra["mtp.layers.0.self_attn.o_proj.weight"],
    )
    # The head is kept for speculative decoding; it does not change the main model's output.
    prompts = mixed_prompts(3)
    sp = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, sp)
    ]
