"""The bundled `metrale-tiny-code` checkpoint (issue 6): format, transformers parity, metrale parity.

Owns the checks that the shipped asset under metrale/assets/tiny-code is what its model card
says: a transformers-loadable Qwen3 checkpoint of at most 16 MB with the documented MTP tensors,
a tokenizer with the three special tokens and a ChatML template, a training record that matches
the weights, a training-side model (tools/tiny_model.py) numerically equal to transformers, and
metrale's greedy output equal to transformers' on real weights. Also a CPU smoke run of
tools/train_tiny.py + tools/eval_tiny.py on a few stdlib files.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ASSET_DIR = ROOT / "metrale" / "assets" / "tiny-code"
TOOLS = ROOT / "tools"
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
]
MAX_BYTES = 16_000_000

transformers = pytest.importorskip("transformers")


def _tools_path() -> None:
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        ASSET_DIR, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSET_DIR)


def _safetensors_shapes() -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(ASSET_DIR / "model.safetensors"), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def test_asset_files_and_size() -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training_record.json",
        "README.md",
    ):
        assert (ASSET_DIR / name).is_file(), name
    assert (ASSET_DIR / "model.safetensors").stat().st_size <= MAX_BYTES


def test_config_is_qwen3() -> None:
    from transformers import AutoConfig, Qwen3Config

    cfg = AutoConfig.from_pretrained(ASSET_DIR)
    assert isinstance(cfg, Qwen3Config)
    assert cfg.architectures == ["Qwen3ForCausalLM"]
    assert cfg.tie_word_embeddings is True
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.head_dim * cfg.num_attention_heads == 256
    raw = json.loads((ASSET_DIR / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1
    assert raw["dtype"] == raw["torch_dtype"] == "bfloat16"


def test_transformers_loads_all_main_weights(hf_model) -> None:
    from safetensors.torch import load_file

    model, info = hf_model
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"], info["missing_keys"]
    assert info["unexpected_keys"], "the MTP tensors should be present (and unused)"
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    sd = load_file(str(ASSET_DIR / "model.safetensors"))
    assert "lm_head.weight" not in sd
    emb = sd["model.embed_tokens.weight"].float()
    torch.testing.assert_close(model.model.embed_tokens.weight, emb, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, emb, rtol=0, atol=0)  # tied
    q = sd["model.layers.5.self_attn.q_norm.weight"].float()
    torch.testing.assert_close(model.model.layers[5].self_attn.q_norm.weight, q, rtol=0, atol=0)


def test_mtp_tensors_have_documented_layout() -> None:
    shapes = _safetensors_shapes()
    h, inter, v = 256, 768, 8192
    assert all(t == "bfloat16" for t in _dtypes())
    assert shapes["model.embed_tokens.weight"] == (v, h)
    expected = {
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.fc.weight": (h, 2 * h),
        "mtp.norm.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.post_attention_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (256, h),
        "mtp.layers.0.self_attn.k_proj.weight": (128, h),
        "mtp.layers.0.self_attn.v_proj.weight": (128, h),
        "mtp.layers.0.self_attn.o_proj.weight": (h, 256),
        "mtp.layers.0.self_attn.q_norm.weight": (64,),
        "mtp.layers.0.self_attn.k_norm.weight": (64,),
        "mtp.layers.0.mlp.gate_proj.weight": (inter, h),
        "mtp.layers.0.mlp.up_proj.weight": (inter, h),
        "mtp.layers.0.mlp.down_proj.weight": (h, inter),
    }
    got = {k: s for k, s in shapes.items() if k.startswith("mtp.")}
    assert got == expected
    for k, s in expected.items():
        if k.startswith("mtp.layers.0."):
            assert shapes[k.replace("mtp.layers.0.", "model.layers.0.")] == s


def _dtypes() -> list[str]:
    raw = (ASSET_DIR / "model.safetensors").read_bytes()[:200_000]
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return [
        v["dtype"].lower().replace("bf16", "bfloat16")
        for k, v in header.items()
        if k != "__metadata__"
    ]


def test_tokenizer_specials_and_chat_template(hf_tokenizer) -> None:
    tok = hf_tokenizer
    assert len(tok) <= 8192
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|endoftext|>"
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert ids == tok(text, add_special_tokens=False).input_ids  # nothing is added
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_start|>user\n").input_ids[0] == 1


def test_training_record_matches_weights_and_bars() -> None:
    rec = json.loads((ASSET_DIR / "training_record.json").read_text())
    digest = hashlib.sha256((ASSET_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert rec["checkpoint_sha256"] == digest
    tok_digest = hashlib.sha256((ASSET_DIR / "tokenizer.json").read_bytes()).hexdigest()
    assert rec["tokenizer_sha256"] == tok_digest
    figs = rec["figures"]
    assert figs["validation_bits_per_byte"] <= 1.8
    assert (
        abs(figs["validation_bits_per_byte"] - figs["reproduction_validation_bits_per_byte"])
        <= 0.05
    )
    assert 0.0 < figs["mtp_top1_accuracy_t2_validation"] < 1.0
    assert len(rec["corpus"]["corpus_sha256"]) == 64


def test_training_model_equals_transformers(hf_model) -> None:
    _tools_path()
    from tiny_model import load_checkpoint

    ours = load_checkpoint(ASSET_DIR, dtype=torch.float32)
    model, _ = hf_model
    ids = torch.randint(3, 8192, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        got, mtp = ours(ids, torch.roll(ids, -1, 1))
    assert ref.std() > 0.5
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert mtp is not None and mtp.shape == ref.shape and torch.isfinite(mtp).all()


def _hf_greedy(model, tok, prompt: str, n: int, **overrides) -> list[int]:
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **overrides
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("plain", [False, True], ids=["generation-config", "plain-greedy"])
def test_metrale_greedy_equals_transformers(hf_model, hf_tokenizer, plain: bool) -> None:
    """Both sides with the checkpoint's generation_config.json (repetition_penalty 1.2), and
    both with it overridden to plain greedy (repetition_penalty 1.0)."""
    from metrale import LLM

    llm = LLM(model=str(ASSET_DIR), device="cpu", dtype="float32")
    overrides = {"repetition_penalty": 1.0} if plain else {}
    params = llm.get_default_sampling_params().replace(temperature=0, max_tokens=32, **overrides)
    assert params.repetition_penalty == (1.0 if plain else 1.2)
    outs = llm.generate(PROMPTS, params)
    model, _ = hf_model
    for prompt, out in zip(PROMPTS, outs, strict=True):
        expected = _hf_greedy(model, hf_tokenizer, prompt, 32, **overrides)
        assert list(out.outputs[0].token_ids) == expected, prompt


def test_train_and_eval_smoke_on_cpu(tmp_path: Path) -> None:
    _tools_path()
    import eval_tiny
    import train_tiny
    from transformers import AutoModelForCausalLM

    out = tmp_path / "ckpt"
    tiny = "--vocab-size 512 --hidden 32 --layers 1 --heads 2 --kv-heads 1 --head-dim 16"
    rec = train_tiny.main(
        [
            "--out", str(out), "--device", "cpu", "--max-train-files", "3", *tiny.split(),
            "--intermediate", "64", "--seq-len", "64", "--batch-size", "2", "--steps", "2",
        ]
    )  # fmt: skip
    assert rec["steps_done"] == 2 and len(rec["corpus"]["corpus_sha256"]) == 64
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.model_type == "qwen3"
    res = eval_tiny.main(
        [
            str(out), "--device", "cpu", "--max-files", "1", "--splits", "validation",
            "--train-sample-bytes", "0", "--stride", "32", "--allow-corpus-mismatch",
        ]
    )  # fmt: skip
    val = res["validation"]
    assert val["tokens_scored"] > 0 and val["bits_per_byte"] > 0
