"""The latency instrument's roofline bytes (`metrale.bench.offline.bytes_per_step`): an MoE
step counts the routed experts only (Qwen3-30B-A3B and Mixtral-8x7B shapes against the
arithmetic of their configs), and a hybrid without `embed_tokens` (Nemotron-H) is measured
instead of failing. Modules are built on the meta device: no memory, no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from metrale.bench.offline import bytes_per_step
from metrale.kernels import kernels_for
from metrale.models.config import parse_model_config, read_config_json
from metrale.models.registry import resolve_architecture

CONFIGS = Path(__file__).resolve().parents[2] / "bench" / "configs"


def _meta_module(name: str) -> torch.nn.Module:
    raw = read_config_json(str(CONFIGS / name))
    _, cls = resolve_architecture(raw.get("architectures"), raw.get("model_type"))
    cfg = parse_model_config(raw, str(CONFIGS / name / "config.json"))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return cls(cfg, kernels_for(torch.device("cpu")), 2048)
    finally:
        torch.set_default_dtype(previous)


def _active_moe_bytes(c: dict, experts_key: str, inter_key: str) -> tuple[int, int]:
    """(dense, routed experts) bytes of a batch-1 step from the config alone (bf16)."""
    h, layers, hd = c["hidden_size"], c["num_hidden_layers"], c.get("head_dim", 128)
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attn = h * q + 2 * h * kv + q * h
    qk_norm = 2 * hd if c["model_type"] == "qwen3_moe" else 0
    router = c[experts_key] * h
    per_layer = attn + qk_norm + 2 * h + router
    dense = layers * per_layer + h + c["vocab_size"] * h + h  # final norm, lm_head, one row
    routed = layers * c["num_experts_per_tok"] * 3 * h * c[inter_key]
    return 2 * dense, 2 * routed


@pytest.mark.parametrize(
    ("name", "experts_key", "inter_key", "active_gb"),
    [
        ("qwen3-30b-a3b", "num_experts", "moe_intermediate_size", (5.9, 6.3)),
        ("mixtral-8x7b", "num_local_experts", "intermediate_size", (25.0, 26.0)),
    ],
)
def test_moe_step_reads_the_routed_experts_only(
    name: str, experts_key: str, inter_key: str, active_gb: tuple[float, float]
) -> None:
    module = _meta_module(name)
    c = json.loads((CONFIGS / name / "config.json").read_text())
    parts = bytes_per_step(module, c["num_hidden_layers"], c["num_key_value_heads"], 128, 1000)
    dense, routed = _active_moe_bytes(c, experts_key, inter_key)
    assert parts["dense"] == dense
    assert parts["experts"] == routed
    assert parts["kv"] == 1000 * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * 128 * 2
    assert parts["total"] == dense + routed + parts["kv"]
    whole = sum(p.numel() * p.element_size() for p in module.parameters())
    assert parts["total"] < whole / 3, "the whole checkpoint is not what a step reads"
    lo, hi = active_gb
    assert lo < (dense + routed) / 1e9 < hi


def test_hybrid_without_embed_tokens_is_measured() -> None:
    module = _meta_module("nemotron-h-8b")
    assert not hasattr(getattr(module, "model", module), "embed_tokens")
    parts = bytes_per_step(module, 4, 8, 128, 100)
    whole = sum(p.numel() * p.element_size() for p in module.parameters())
    assert 0 < parts["dense"] < whole
    assert parts["experts"] == 0
