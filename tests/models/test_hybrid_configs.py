"""Config layouts of the MoE and hybrid families: the published form (Nemotron-H's
`hybrid_override_pattern` string, Qwen3-Next's `full_attention_interval`, top-level
`rope_theta` / `partial_rotary_factor`, `num_experts`) and transformers 5's (block and layer
type lists, `rope_parameters`, `num_local_experts`) describe the same model; settings metrale
cannot serve are refused with a `CheckpointError` naming them."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from metrale.errors import CheckpointError
from metrale.kernels import kernels_for
from metrale.models.config import parse_model_config
from metrale.models.nemotron_h import NemotronHForCausalLM, block_types
from metrale.models.qwen3_next import Qwen3NextForCausalLM
from metrale.models.registry import resolve_architecture
from tests.helpers.checkpoints import HYBRID_VARIANTS, MOE_VARIANTS, build

OPS = kernels_for(torch.device("cpu"))


def config_of(name: str) -> dict[str, Any]:
    variant = next(v for v in HYBRID_VARIANTS + MOE_VARIANTS if v.name == name)
    return json.loads((build(variant) / "config.json").read_text())


def test_nemotron_pattern_string_and_block_list_agree() -> None:
    listed = config_of("nemotronh-moe")  # transformers 5: a list, no num_hidden_layers
    assert "num_hidden_layers" not in listed and "hybrid_override_pattern" not in listed
    classic = config_of("nemotronh-classic")  # published: the pattern string
    assert classic["hybrid_override_pattern"] == "M-M*" and "layers_block_type" not in classic
    assert block_types(listed) == ["mamba", "attention", "mlp", "mamba", "moe"]
    assert block_types(classic) == ["mamba", "mlp", "mamba", "attention"]
    assert parse_model_config(listed).num_hidden_layers == 5
    pattern = {**listed, "hybrid_override_pattern": "M*-ME"}
    del pattern["layers_block_type"]
    assert block_types(pattern) == block_types(listed)


@pytest.mark.parametrize("v5,classic", [("qwen3next", "qwen3next-classic")])
def test_qwen3_next_interval_and_partial_rotary_read_from_either_layout(
    v5: str, classic: str
) -> None:
    a, b = config_of(v5), config_of(classic)
    assert "layer_types" in a and "layer_types" not in b and b["full_attention_interval"] == 2
    assert b["partial_rotary_factor"] == 0.25 and "rope_parameters" not in b
    ma = Qwen3NextForCausalLM(parse_model_config(a), OPS, 64)
    mb = Qwen3NextForCausalLM(parse_model_config(b), OPS, 64)
    assert [layer.kind for layer in ma.model.layers] == ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert [layer.kind for layer in mb.model.layers] == ["linear_attention", "full_attention"] * 2
    assert ma.config.rotary_dim == mb.config.rotary_dim == 4  # 0.25 of head_dim 16


def test_registry_knows_every_family_by_name_and_model_type() -> None:
    for variant in HYBRID_VARIANTS + MOE_VARIANTS:
        cfg = config_of(variant.name)
        name, _ = resolve_architecture(cfg["architectures"], None)
        assert resolve_architecture(None, cfg["model_type"])[0] == name


def _refused(raw: dict[str, Any], cls: type, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        cls(parse_model_config(raw), OPS, 64)


def test_unservable_settings_are_refused_by_name() -> None:
    nemotron = config_of("nemotronh-moe")
    _refused({**nemotron, "layers_block_type": ["mamba", "hyena"]}, NemotronHForCausalLM, "hyena")
    pattern = {**nemotron, "hybrid_override_pattern": "M*X"}
    del pattern["layers_block_type"]
    _refused(pattern, NemotronHForCausalLM, "'X'")
    _refused({**nemotron, "moe_latent_size": 16}, NemotronHForCausalLM, "moe_latent_size")
    qwen = {**config_of("qwen3next"), "moe_intermediate_size": None}
    _refused(qwen, Qwen3NextForCausalLM, "moe_intermediate_size")
    bad_types = {**config_of("qwen3next"), "layer_types": ["linear_attention"] * 3 + ["sliding"]}
    _refused(bad_types, Qwen3NextForCausalLM, "sliding")
