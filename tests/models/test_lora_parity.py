"""LoRA adapters against peft on transformers: greedy tokens identical and logprobs within
1e-4, float32 on the CPU, for tiny Llama and Qwen3 checkpoints with two adapters that differ
in target modules, rank and scaling (`lora_alpha / r` and rsLoRA's `lora_alpha / sqrt(r)`),
all in one mixed batch with the base model, prompts long enough to run in several prefill
chunks; and an attention adapter on a Qwen3-MoE checkpoint (an expert adapter is refused)."""

from __future__ import annotations

import pytest

from metrale import LLM, LoRARequest, SamplingParams
from metrale.errors import InvalidRequestError
from tests.helpers.checkpoints import DENSE_VARIANTS, MOE_VARIANTS, Variant, build, load_hf
from tests.helpers.engine_checks import assert_no_leaks
from tests.helpers.lora import ADAPTER_A, ADAPTER_B, AdapterSpec, build_adapter, peft_model
from tests.helpers.parity import assert_matches, hf_greedy, mixed_prompts

NEW_TOKENS = 16
VARIANTS = [v for v in DENSE_VARIANTS if v.name in ("llama-gqa2", "qwen3-qknorm")]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_adapters_match_peft_in_one_mixed_batch(variant: Variant) -> None:
    base = build(variant)
    path_a, path_b = build_adapter(base, ADAPTER_A), build_adapter(base, ADAPTER_B)
    req_a = LoRARequest(ADAPTER_A.name, 1, str(path_a))
    req_b = LoRARequest(ADAPTER_B.name, 2, str(path_b))
    prompts = mixed_prompts(8)[2:8]  # 9 to 200 tokens
    adapters = [req_a, req_b, None, req_b, req_a, None]
    llm = LLM(
        str(base), device="cpu", dtype="float32", num_kv_blocks=200, enable_lora=True,
        max_loras=2, max_prefill_chunk=48,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=5)
    outs = llm.generate(prompts, params, lora_request=adapters)
    base_outs = llm.generate(prompts, params)
    references = {
        None: load_hf(base),
        ADAPTER_A.name: peft_model(base, ADAPTER_A),
        ADAPTER_B.name: peft_model(base, ADAPTER_B),
    }
    for prompt, out, req in zip(prompts, outs, adapters, strict=True):
        ref = references[req.lora_name if req is not None else None]
        assert_matches(out, hf_greedy(ref, prompt, NEW_TOKENS))
    # The adapters really change the output (else the comparison above proves little).
    for out, base_out, req in zip(outs, base_outs, adapters, strict=True):
        if req is None:
            assert out.outputs[0].token_ids == base_out.outputs[0].token_ids
        else:
            assert out.outputs[0].token_ids != base_out.outputs[0].token_ids
    stats = llm.engine.lora_stats()
    assert stats["resident"] == 2 and stats["evictions"] == 0
    assert_no_leaks(llm.engine)


def test_moe_model_attention_adapter_matches_peft_and_expert_adapter_is_refused() -> None:
    """On Qwen3-MoE, an adapter of the attention projections matches peft; one whose targets
    reach the experts (peft turns `down_proj` into `target_parameters` of the fused experts)
    is refused at load, naming the file, and the engine serves on."""
    base = build(MOE_VARIANTS[0])
    attn = AdapterSpec("moe-attn", ("q_proj", "o_proj"), rank=4, alpha=8, seed=3)
    experts = AdapterSpec("moe-experts", ("q_proj", "down_proj"), rank=4, alpha=8, seed=4)
    llm = LLM(str(base), device="cpu", dtype="float32", num_kv_blocks=160, enable_lora=True)
    with pytest.raises(InvalidRequestError, match=r"adapter_config\.json: target_parameters"):
        llm.engine.load_lora_adapter("experts", str(build_adapter(base, experts)))
    prompts = mixed_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=5)
    req = LoRARequest(attn.name, 1, str(build_adapter(base, attn)))
    outs = llm.generate(prompts, params, lora_request=req)
    reference = peft_model(base, attn)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out, hf_greedy(reference, prompt, NEW_TOKENS))
    assert_no_leaks(llm.engine)
