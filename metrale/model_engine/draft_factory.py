"""Loading a draft checkpoint for speculative decoding (`speculative_config` method
`draft_model`): its vocabulary checked against the target's before any weights load, its
footprint (weights and one KV block per target block) for the target's KV budget, and the
draft model itself beside the target.

Owner: model-engine (`factory` budgets with `_draft_footprint`; `engine.draft_proposer`
loads with `load_draft_model`).

Invariants:
- A draft whose vocabulary differs from the target's (size, or the tokens at the same ids when
  both have a `tokenizer.json`) is refused at start-up naming both checkpoints; so is a draft
  with recurrent layers.
- The draft's KV pool has as many blocks, of the target's block size, as the target's pool,
  in the model dtype; `factory` has already counted its bytes in the target's budget.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.cache.kv_cache import PagedKVCache
from metrale.config import EngineConfig
from metrale.errors import CheckpointError
from metrale.kernels import kernels_for
from metrale.model_engine.gpu_setup import warm_forward_shapes
from metrale.model_engine.load_setup import default_dtype, dummy_init
from metrale.model_engine.transformer_model import TransformerModel
from metrale.models.config import ModelConfig, parse_model_config, read_config_json
from metrale.models.loader import load_weights
from metrale.models.quantization import parse_quantization
from metrale.models.registry import resolve_architecture

logger = logging.getLogger(__name__)


@dataclass
class DraftFootprint:
    """What a draft checkpoint will take, read from its config without loading weights."""

    model_dir: str
    config: ModelConfig
    weights_bytes: int
    #: Bytes of one draft KV block of the target's block size (tokens).
    per_block: int


def draft_checkpoint_dir(config: EngineConfig) -> str | None:
    """The draft checkpoint of `speculative_config` (method `draft_model`), else None."""
    spec = config.speculative()
    if spec is None or spec.method != "draft_model":
        return None
    return spec.model


def _read_vocab(tokenizer_json: Path) -> tuple[Any, list[tuple[int, str]]]:
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    model = data.get("model") or {}
    added = sorted((int(t["id"]), str(t["content"])) for t in data.get("added_tokens") or [])
    return model.get("vocab"), added


def check_draft_vocab(
    target_dir: str | None, target_vocab: int, draft_dir: str, draft_vocab: int
) -> None:
    """A draft proposes target token ids, so both checkpoints must share one vocabulary:
    the same `vocab_size` and, where both directories hold a `tokenizer.json`, the same
    tokens at the same ids. Anything else is a `CheckpointError` naming both."""
    target_name = target_dir or "the target model"
    if draft_vocab != target_vocab:
        raise CheckpointError(
            f"speculative_config.model: the draft checkpoint {draft_dir} has vocab_size "
            f"{draft_vocab} but the target {target_name} has {target_vocab}; a draft model "
            "must share the target's vocabulary"
        )
    if target_dir is None:
        return
    a, b = Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"
    if not (a.is_file() and b.is_file()) or a.resolve() == b.resolve():
        return
    try:
        same = _read_vocab(a) == _read_vocab(b)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot compare the tokenizers of {a} and {b}: {exc}") from exc
    if not same:
        raise CheckpointError(
            f"speculative_config.model: the draft checkpoint's tokenizer ({b}) differs from "
            f"the target's ({a}) although both have vocab_size {target_vocab}; a draft model "
            "must share the target's vocabulary (the same tokens at the same ids)"
        )


def _draft_footprint(
    config: EngineConfig,
    target_dir: str,
    target: ModelConfig,
    dtype: torch.dtype,
    max_model_len: int,
) -> DraftFootprint | None:
    """The draft checkpoint's vocabulary checked and its bytes counted (a module built on
    the meta device: no memory, no weights read), before the target loads."""
    draft_dir = draft_checkpoint_dir(config)
    if draft_dir is None:
        return None
    raw = read_config_json(draft_dir)
    _, cls = resolve_architecture(raw.get("architectures"), raw.get("model_type"))
    dcfg = parse_model_config(raw, str(Path(draft_dir) / "config.json"))
    check_draft_vocab(target_dir, target.vocab_size, draft_dir, dcfg.vocab_size)
    draft_len = min(max_model_len, dcfg.max_position_embeddings)
    with torch.device("meta"), default_dtype(dtype):
        module = cls(dcfg, kernels_for(torch.device("cpu")), draft_len)
    _refuse_hybrid_draft(module, draft_dir)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    per_block = PagedKVCache.bytes_per_block(
        module.kv_layer_count, config.block_size, dcfg.num_key_value_heads, dcfg.head_dim, dtype
    )
    return DraftFootprint(draft_dir, dcfg, weights, per_block)


def _refuse_hybrid_draft(module: torch.nn.Module, draft_dir: str) -> None:
    if hasattr(module, "ssm_layer_specs") and module.ssm_layer_specs():
        raise CheckpointError(
            f"speculative_config.model: the draft checkpoint {draft_dir} has recurrent (SSM) "
            "layers, whose state a rejected draft cannot roll back; use a dense or MoE draft"
        )


def load_draft_model(
    draft_dir: str,
    target: TransformerModel,
    load_format: str = "auto",
    target_dir: str | None = None,
    max_num_seqs: int = 32,
) -> TransformerModel:
    """The draft checkpoint as its own `TransformerModel` on the target's device and dtype:
    its own KV pool of as many blocks of the target's block size as the target's (the same
    token capacity; `load_model` budgeted its bytes), no prefix cache, eager forwards (no
    CUDA graphs; on CUDA its kernels are compiled for the shapes of up to `max_num_seqs` rows
    at load), context capped at the target's `max_model_len`. Quantized drafts load as
    quantized targets do (`quantization.py`)."""
    start = time.perf_counter()
    raw = read_config_json(draft_dir)
    arch_name, cls = resolve_architecture(raw.get("architectures"), raw.get("model_type"))
    mcfg = parse_model_config(raw, str(Path(draft_dir) / "config.json"))
    check_draft_vocab(target_dir, target.vocab_size(), draft_dir, mcfg.vocab_size)
    device, dtype = target.device, target.dtype
    max_model_len = min(target.max_model_len, mcfg.max_position_embeddings)
    ops = kernels_for(device)
    with torch.device(device), default_dtype(dtype):
        module = cls(mcfg, ops, max_model_len)
    module.eval()
    _refuse_hybrid_draft(module, draft_dir)
    quant = parse_quantization(raw, str(Path(draft_dir) / "config.json"))
    if load_format == "dummy":
        dummy_init(module)
    else:
        absent = load_weights(module, draft_dir, module.weight_mapping(), quant=quant)
        if absent:
            module.drop_optional_weights(absent)
    num_blocks = target.kv_cache.num_blocks
    kv = PagedKVCache(
        module.kv_layer_count, num_blocks, target.block_size, mcfg.num_key_value_heads,
        mcfg.head_dim, dtype, device,
    )  # fmt: skip
    model = TransformerModel(
        module, mcfg, kv, device, dtype, max_model_len, enable_prefix_caching=False
    )
    model.kernel_implementations = dict(ops.implementations)
    model.kernel_ops = ops
    if device.type == "cuda":  # its kernels compile now, not in the first requests' steps
        warm = warm_forward_shapes(model, max_num_seqs)
        logger.info("draft model kernels compiled for the common shapes in %.1fs", warm)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    per_block = PagedKVCache.bytes_per_block(
        module.kv_layer_count, target.block_size, mcfg.num_key_value_heads, mcfg.head_dim, dtype
    )
    logger.info(
        "loaded draft %s (%s): weights %.1f MiB, KV %d usable blocks (%.1f MiB) in %.2fs",
        draft_dir, arch_name, weights / 2**20, num_blocks - 1, num_blocks * per_block / 2**20,
        time.perf_counter() - start,
    )  # fmt: skip
    return model
