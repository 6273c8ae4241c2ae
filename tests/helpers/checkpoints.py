"""Tiny random checkpoints of every supported architecture, written by transformers.

Owner: tests. Each `Variant` names an architecture and the config switches it exercises
(tied embeddings, GQA ratio, q/k norm, biases, rope scaling, config layout); `build()` writes a
real Hugging Face checkpoint (config.json + model.safetensors + tokenizer files) so the loader
under test reads exactly what users' checkpoints hold.

Invariants:
- Deterministic: the same variant always gets the same weights (seeded init).
- Built once per process per variant, into a temporary directory removed at exit.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.tiny_tokenizer import copy_tokenizer_into

COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


@dataclass(frozen=True, eq=False)
class Variant:
    name: str
    arch: str  # llama | mistral | qwen2 | qwen3 | ...
    overrides: tuple[tuple[str, Any], ...] = ()
    #: Rewrite config.json into the classic layout (top-level rope_theta / rope_scaling /
    #: torch_dtype) that published checkpoints use.
    classic_layout: bool = False
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Variant) and other.name == self.name

    def config_kwargs(self) -> dict[str, Any]:
        return {**COMMON, **dict(self.overrides)}


def _rope(kind: str, **params: Any) -> tuple[str, Any]:
    return ("rope_parameters", {"rope_type": kind, "rope_theta": 10000.0, **params})


DENSE_VARIANTS: list[Variant] = [
    Variant("llama-gqa2", "llama"),
    Variant("llama-tied-mha-linear", "llama", (("tie_word_embeddings", True), ("num_key_value_heads", 4), _rope("linear", factor=2.0))),
    Variant("llama-gqa4-llama3", "llama", (("num_key_value_heads", 1), _rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64))),
    Variant("llama-headdim-yarn-bias", "llama", (("head_dim", 32), ("attention_bias", True), _rope("yarn", factor=4.0, original_max_position_embeddings=128))),
    Variant("llama-classic-llama3", "llama", (_rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),), classic_layout=True),
    Variant("mistral-window", "mistral", (("sliding_window", 48),)),
    Variant("qwen2-bias-tied", "qwen2", (("tie_word_embeddings", True),)),
    Variant("qwen3-qknorm", "qwen3", (("head_dim", 16),)),
    Variant("qwen3-classic-yarn-gqa4", "qwen3", (("head_dim", 16), ("num_key_value_heads", 1), _rope("yarn", factor=2.0, original_max_position_embeddings=256)), classic_layout=True),
]  # fmt: skip


#: Draft checkpoints (speculative_config method "draft_model") of the dense variants: another
#: family, one layer, half the width, other weights, the same vocabulary and tokenizer; and one
#: whose vocab_size differs (refused at start-up). `truncated` gives a draft that agrees more.
DRAFT_VARIANTS: list[Variant] = [
    Variant("qwen3-draft-small", "qwen3", (("num_hidden_layers", 1), ("hidden_size", 32), ("intermediate_size", 64), ("num_attention_heads", 2), ("num_key_value_heads", 1), ("head_dim", 16)), seed=2),
    Variant("llama-draft-vocab256", "llama", (("num_hidden_layers", 1), ("vocab_size", 256)), seed=3),
]  # fmt: skip


_MAMBA = dict(
    mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16
)
_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)

MOE_VARIANTS: list[Variant] = [
    Variant("qwen3moe-norm-dense1", "qwen3_moe", tuple(dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]).items())),
    Variant("qwen3moe-classic", "qwen3_moe", tuple(dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False).items()), classic_layout=True),
    Variant("mixtral-classic", "mixtral", tuple(dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64).items()), classic_layout=True),
]  # fmt: skip

HYBRID_VARIANTS: list[Variant] = [
    # Mamba-2, NoPE attention, MLP and a sigmoid-routed MoE; transformers 5 layout (lists).
    Variant("nemotronh-moe", "nemotron_h", tuple(dict(num_hidden_layers=5, hybrid_override_pattern="M*-ME", head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=1.5, **_MAMBA).items())),
    # Published layout: hybrid_override_pattern string, top-level rope_theta.
    Variant("nemotronh-classic", "nemotron_h", tuple(dict(num_hidden_layers=4, hybrid_override_pattern="M-M*", head_dim=16, **_MAMBA).items()), classic_layout=True),
    Variant("bamba", "bamba", tuple(dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16).items())),
    Variant("qwen3next", "qwen3_next", tuple(dict(num_hidden_layers=4, head_dim=16, layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[1], **_LINEAR).items())),
    # Published layout: full_attention_interval, top-level rope_theta / partial_rotary_factor.
    Variant("qwen3next-classic", "qwen3_next", tuple(dict(num_hidden_layers=4, head_dim=16, full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=False, **_LINEAR).items()), classic_layout=True),
]  # fmt: skip


def _classes(arch: str) -> tuple[type, type]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "nemotron_h": (tf.NemotronHConfig, tf.NemotronHForCausalLM),
        "bamba": (tf.BambaConfig, tf.BambaForCausalLM),
        "qwen3_next": (tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM),
    }[arch]


_BLOCK_CHARS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def to_classic_layout(config_path: Path) -> None:
    """Rewrite a transformers-5 config.json into the layout published checkpoints use."""
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    else:
        cfg["rope_scaling"] = None
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    partial = rope.pop("partial_rotary_factor", None)
    if partial is not None and cfg.get("model_type") != "bamba":  # Bamba files omit it
        cfg["partial_rotary_factor"] = partial
    # Family fields as published checkpoints write them.
    model_type = cfg.get("model_type")
    if model_type == "nemotron_h":
        types = cfg.pop("layers_block_type")
        cfg["hybrid_override_pattern"] = "".join(_BLOCK_CHARS[t] for t in types)
        cfg["num_hidden_layers"] = len(types)
    elif model_type == "qwen3_next":
        types = cfg.pop("layer_types")
        interval = types.index("full_attention") + 1
        assert all(
            (t == "full_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types)
        )
        cfg["full_attention_interval"] = interval
    elif model_type == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    config_path.write_text(json.dumps(cfg, indent=2))


def write_checkpoint(variant: Variant, out: Path, *, max_shard_size: str | None = None) -> Path:
    import torch

    config_cls, model_cls = _classes(variant.arch)
    torch.manual_seed(variant.seed)
    config = config_cls(**variant.config_kwargs())
    model = model_cls(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if variant.classic_layout:
        to_classic_layout(out / "config.json")
    copy_tokenizer_into(out)
    return out


@functools.cache
def build(variant: Variant) -> Path:
    """The checkpoint directory of `variant`, built once per process; do not modify it."""
    out = Path(tempfile.mkdtemp(prefix=f"metrale-{variant.name}-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return write_checkpoint(variant, out)


@functools.cache
def truncated(variant: Variant, num_layers: int) -> Path:
    """`variant`'s checkpoint cut to its first `num_layers` decoder layers (embeddings, final
    norm and LM head kept): a layer-skip draft that often agrees with the full model."""
    model = load_hf(build(variant))
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    out = Path(tempfile.mkdtemp(prefix=f"metrale-{variant.name}-{num_layers}l-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    model.save_pretrained(out)
    copy_tokenizer_into(out)
    return out


def copy_checkpoint(variant: Variant, dst: Path) -> Path:
    """A private, modifiable copy of a variant's checkpoint (for corruption tests)."""
    shutil.copytree(build(variant), dst, dirs_exist_ok=True)
    return dst


def load_hf(path: Path, dtype: str = "float32") -> Any:
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
