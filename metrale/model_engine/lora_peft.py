"""Reading a PEFT LoRA adapter for a loaded model: `read_peft_adapter` (its
`adapter_config.json` and `adapter_model.safetensors`, checked against the base model's
adaptable projections, `adaptable_shapes`), `PeftAdapter` (the weights, ready for a slot),
and `LoraAdapterError`.

Owner: model-engine. Invariants:
- An adapter is read and checked in full (config, every tensor's name, rank and shape against
  the base model) before it is returned: a bad adapter raises `LoraAdapterError` naming the
  file and the tensor; nothing outside the returned `PeftAdapter` is touched.
- Adaptable projections are those of the main decoder layers' dense attention blocks and
  gated MLPs (not MoE experts, not recurrent mixers, not an MTP head).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from metrale.errors import InvalidRequestError
from metrale.layers.common import GatedMLP, PagedSelfAttention
from metrale.layers.lora import LORA_TARGETS

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z_]+)"
    r"\.lora_(A|B)(?:\.[A-Za-z0-9_\-]+)?\.weight$"
)
_MODULE_OF = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}  # fmt: skip


class LoraAdapterError(InvalidRequestError):
    """An adapter that cannot be served (bad files, unsupported features, wrong shapes)."""


@dataclass
class PeftAdapter:
    """One adapter's weights on the host: per (layer, target), `(A [r, in], B [out, r],
    scale)` in the model's dtype."""

    name: str
    path: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    rank: int

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b, _ in self.weights.values())  # fmt: skip


def _refuse(path: Path, what: str) -> LoraAdapterError:
    return LoraAdapterError(f"LoRA adapter {path}: {what}", param="lora")


def read_peft_adapter(
    name: str,
    path: str,
    shapes: dict[tuple[int, str], tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
) -> PeftAdapter:
    """Read and check the PEFT adapter in directory `path` against the base model's adaptable
    projections `shapes` ((layer, target) -> (in, out)); raises `LoraAdapterError` naming the
    file and the tensor on any problem."""
    root = Path(path)
    cfg_path = root / CONFIG_FILE
    if not root.is_dir():
        raise _refuse(root, "is not a directory")
    if not cfg_path.is_file():
        raise _refuse(cfg_path, "missing (a PEFT adapter directory holds adapter_config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise _refuse(cfg_path, f"unreadable: {exc}") from None
    if not isinstance(cfg, dict):
        raise _refuse(cfg_path, "is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(cfg_path, f"peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("modules_to_save"):
        raise _refuse(
            cfg_path,
            f"modules_to_save {cfg['modules_to_save']!r} is not supported (the adapter "
            "replaces whole base modules; only low-rank deltas are served)",
        )
    if cfg.get("target_parameters"):
        raise _refuse(
            cfg_path,
            f"target_parameters {cfg['target_parameters']!r}: adapters of MoE experts (or of "
            "any raw parameter) are not supported",
        )
    for key, why in (
        ("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights"),
        ("alpha_pattern", "per-module alpha (alpha_pattern)"), ("lora_bias", "LoRA biases"),
        ("trainable_token_indices", "trainable token embeddings"),
        ("layer_replication", "layer replication"), ("use_qalora", "QA-LoRA"),
        ("alora_invocation_tokens", "activated LoRA (aLoRA)"),
    ):  # fmt: skip
        if cfg.get(key):
            raise _refuse(cfg_path, f"{why} is not supported ({key}: {cfg[key]!r})")
    if cfg.get("bias", "none") not in ("none", None):
        raise _refuse(cfg_path, f"bias {cfg['bias']!r} is not supported (only 'none')")
    try:
        alpha = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    except (TypeError, ValueError):
        raise _refuse(cfg_path, f"lora_alpha {cfg.get('lora_alpha')!r} is not a number") from None
    rslora = bool(cfg.get("use_rslora", False))
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        raise _refuse(weights_path, "missing (only safetensors adapters are read)")
    from safetensors import safe_open

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            names = list(f.keys())
            for tname in names:
                m = _TENSOR.match(tname)
                if m is None:
                    if ".experts." in tname:
                        raise _refuse(
                            weights_path,
                            f"tensor {tname}: adapters of MoE experts are not supported",
                        )
                    raise _refuse(
                        weights_path,
                        f"tensor {tname}: not a LoRA A/B weight of a supported projection "
                        f"({', '.join(LORA_TARGETS)})",
                    )
                layer, module, target, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
                if _MODULE_OF.get(target) != module:
                    raise _refuse(
                        weights_path, f"tensor {tname}: {module}.{target} is not a LoRA target"
                    )
                if (layer, target) not in shapes:
                    raise _refuse(
                        weights_path,
                        f"tensor {tname}: the base model has no adaptable {module}.{target} "
                        f"in layer {layer} (MoE expert and recurrent layers cannot be adapted)",
                    )
                pairs.setdefault((layer, target), {})[ab] = f.get_tensor(tname)
    except LoraAdapterError:
        raise
    except Exception as exc:  # safetensors raises its own types for corrupt files
        raise _refuse(weights_path, f"unreadable: {exc}") from None
    if not pairs:
        raise _refuse(weights_path, "holds no LoRA tensors")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]] = {}
    top_rank = 0
    for (layer, target), ab in sorted(pairs.items()):
        where = f"model.layers.{layer}.{_MODULE_OF[target]}.{target}"
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise _refuse(weights_path, f"tensor {where}.{missing}.weight is missing")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[(layer, target)]
        if a.dim() != 2 or b.dim() != 2:
            raise _refuse(weights_path, f"tensor {where}.lora_A/B.weight: expected 2-D weights")
        r = a.shape[0]
        if a.shape[1] != fan_in:
            raise _refuse(
                weights_path,
                f"tensor {where}.lora_A.weight has shape {list(a.shape)}; the base model's "
                f"{target} takes {fan_in} inputs (is this adapter for another base model?)",
            )
        if b.shape != (fan_out, r):
            raise _refuse(
                weights_path,
                f"tensor {where}.lora_B.weight has shape {list(b.shape)}; expected "
                f"[{fan_out}, {r}] (the base model's {target} outputs and the rank of lora_A)",
            )
        if not 1 <= r <= max_rank:
            raise _refuse(
                weights_path,
                f"tensor {where}.lora_A.weight: rank {r} exceeds --max-lora-rank {max_rank}",
            )
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        weights[(layer, target)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous(), scale)
        top_rank = max(top_rank, r)
    return PeftAdapter(name, str(root), weights, top_rank)


def adaptable_shapes(module: nn.Module) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, target) -> (in, out) of every projection of the main decoder layers an adapter
    may target: dense attention blocks and gated MLPs (not MoE experts, not recurrent
    mixers, not an MTP head)."""
    shapes: dict[tuple[int, str], tuple[int, int]] = {}
    for layer_idx, layer in enumerate(main_layers(module)):
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, PagedSelfAttention):
            hidden = attn.qkv_proj.in_features
            shapes[(layer_idx, "q_proj")] = (hidden, attn.q_size)
            shapes[(layer_idx, "k_proj")] = (hidden, attn.kv_size)
            shapes[(layer_idx, "v_proj")] = (hidden, attn.kv_size)
            shapes[(layer_idx, "o_proj")] = (attn.q_size, attn.o_proj.out_features)
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, GatedMLP):
            hidden = mlp.gate_up_proj.in_features
            inter = mlp.down_proj.in_features
            shapes[(layer_idx, "gate_proj")] = (hidden, inter)
            shapes[(layer_idx, "up_proj")] = (hidden, inter)
            shapes[(layer_idx, "down_proj")] = (inter, hidden)
    return shapes


def main_layers(module: nn.Module) -> list[nn.Module]:
    """The main decoder layers of `module` (those adapters attach to)."""
    stack = getattr(module, "model", None)
    layers = getattr(stack, "layers", None)
    if layers is None:
        raise LoraAdapterError(
            f"{type(module).__name__} has no decoder layers LoRA adapters can attach to"
        )
    return list(layers)
