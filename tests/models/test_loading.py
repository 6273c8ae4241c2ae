"""Checkpoint loading: sharded files, dtypes, and a clear error for every way a checkpoint can
be broken (unknown architecture, missing / truncated file, missing tensor, wrong shape,
unsupported rope)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale import LLM, SamplingParams
from metrale.errors import CheckpointError
from tests.helpers.checkpoints import DENSE_VARIANTS, copy_checkpoint, write_checkpoint
from tests.helpers.parity import mixed_prompts

VARIANT = next(v for v in DENSE_VARIANTS if v.name == "llama-gqa2")
GREEDY = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, logprobs=0)


def load(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), device="cpu", num_kv_blocks=64, **kwargs)


def edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path) -> None:
    single = load(copy_checkpoint(VARIANT, tmp_path / "single"))
    sharded_dir = write_checkpoint(VARIANT, tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 1
    sharded = load(sharded_dir)
    prompts = mixed_prompts(3)
    a = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
    b = [o.outputs[0].token_ids for o in sharded.generate(prompts, GREEDY)]
    assert a == b


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_load_and_generate(tmp_path: Path, dtype: str) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    llm = load(path, dtype=dtype)
    weights = next(llm.engine.model.module.parameters())
    assert weights.dtype == getattr(torch, dtype)
    exact = load(path)
    prompt = mixed_prompts(4)[3]
    half = llm.generate([prompt], GREEDY)[0].outputs[0]
    full = exact.generate([prompt], GREEDY)[0].outputs[0]
    assert half.token_ids[:4] == full.token_ids[:4]
    assert all(
        abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) < 0.1
        for a, b in zip(half.logprobs[:4], full.logprobs[:4])
    )


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    edit_config(path, architectures=["FooBarForCausalLM"], model_type="foobar")
    with pytest.raises(CheckpointError, match="FooBarForCausalLM"):
        load(path)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load(path)


def test_missing_part_of_a_fused_weight_is_named(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.qkv_proj.*k_proj"):
        load(path)


def test_truncated_file_is_named(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(path)


def test_missing_weight_file_is_reported(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load(path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    edit_config(path, intermediate_size=96)
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor .*(down|gate|up)_proj\.weight. has shape .*(128|96).* but the config implies",
    ):
        load(path)


def test_dynamic_rope_is_refused(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    edit_config(
        path, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(CheckpointError, match="dynamic"):
        load(path)


def test_missing_config_is_reported(tmp_path: Path) -> None:
    path = copy_checkpoint(VARIANT, tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load(path)
