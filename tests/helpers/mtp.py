"""Tiny checkpoints with an MTP head: a test variant's checkpoint plus `mtp.*` tensors
(`num_nextn_predict_layers: 1`), the head's decoder layer copied from one of the main
model's layers with noise, so its drafts are neither random nor the main model's own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.checkpoints import Variant, build


def with_mtp_head(variant: Variant, dst: Path, source_layer: int, seed: int = 0) -> Path:
    """A copy of `variant`'s checkpoint in `dst` with one MTP layer built from main layer
    `source_layer` (a full-attention layer for hybrids)."""
    shutil.copytree(build(variant), dst, dirs_exist_ok=True)
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    files = sorted(dst.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"expected one safetensors file in {dst}, found {len(files)}")
    tensors = load_file(str(files[0]))
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{source_layer}."
    hidden = config["hidden_size"]
    dtype = tensors["model.embed_tokens.weight"].dtype
    offset = config.get("model_type") == "qwen3_next"  # its norms scale by (1 + w)
    for name, t in list(tensors.items()):
        if name.startswith(prefix):
            noise = 1 + 0.3 * torch.randn(t.shape, generator=g)
            tensors["mtp.layers.0." + name[len(prefix) :]] = (t.float() * noise).to(t.dtype)
    tensors["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) * 0.05).to(dtype)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        base = 0.0 if offset else 1.0
        tensors[f"mtp.{norm}.weight"] = (base + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(files[0]))
    return dst
