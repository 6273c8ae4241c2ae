"""Building a `TransformerModel` from a checkpoint directory and an `EngineConfig`: device and
dtype resolution, module construction, weights, KV pool sizing.

Owner: model-engine.

Invariants:
- The KV pool has exactly `num_kv_blocks` blocks when the config sets it, on any device.
- Otherwise it is sized from a memory budget, and it always holds at least one sequence of
  `max_model_len` tokens, or loading fails with a message saying which setting to change.
- `max_model_len` never exceeds the checkpoint's `max_position_embeddings`.
- Hybrid models get an SSM slot pool of exactly `max_num_seqs` slots (float32 recurrent
  state); its bytes come out of the KV budget, so the two never overcommit memory together.
- FP8 weights (`fp8_weights`: an FP8 checkpoint or `--quantization fp8`, CUDA only) are
  converted before the KV budget is read and counted at 1 byte per weight, so the pool gets
  the memory they free; `LoadReport.weight_dtype` names the weights' dtype.
- With a draft checkpoint (`speculative_config` method `draft_model`) the draft's vocabulary
  is checked before any weights load, and the budget pays for the draft too: its weights
  (CUDA) and, per target KV block, one draft block of the same token count, so the draft's
  pool (`load_draft_model`: as many blocks as the target's) never overcommits memory either.
- The KV pool's dtype is `kv_cache_dtype` (`resolve_kv_dtype`): the model dtype, or float8
  E4M3 whose block bytes (and so the blocks a budget holds) follow the float8 element size.
  A float8 pool takes its per-layer scales from the checkpoint (`k_scale` / `v_scale` /
  `kv_scale` under each attention module, all layers or none) or, lacking them, is armed
  to calibrate on the first prefill after the warm-up forwards (`metrale.cache.kv_cache`).
  A draft model's pool stays in the model dtype.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metrale.cache.block_pool import blocks_for
from metrale.cache.kv_cache import PagedKVCache
from metrale.cache.kv_tiers import KvTiers
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.config import EngineConfig
from metrale.errors import CheckpointError, InvalidRequestError
from metrale.kernels import kernels_for
from metrale.layers.common import AttentionProjections
from metrale.layers.moe import FusedExperts
from metrale.model_engine import fp8_weights
from metrale.model_engine.cuda_graphs import RECURRENT_DECODE_OPS, DecodeGraphRunner
from metrale.model_engine.gpu_setup import (
    GRAPH_RESERVE_BYTES,
    StartupBreakdown,
    kv_budget_bytes,
    warm_forward_shapes,
)
from metrale.model_engine.lora import lora_slot_bytes
from metrale.model_engine.mtp import require_mtp_head
from metrale.model_engine.mtp_graphs import MtpGraphRunner
from metrale.model_engine.ssm_prefix import NEAR_BLOCKS
from metrale.model_engine.transformer_model import TransformerModel
from metrale.models.config import ModelConfig, parse_model_config, read_config_json
from metrale.models.loader import checkpoint_files, load_weights
from metrale.models.quantization import parse_quantization
from metrale.models.registry import resolve_architecture
from metrale.progress import LoadProgress, NullProgress, human_bytes

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(
            "device 'cuda' was asked for but no CUDA device is available", param="device"
        )
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


#: `kv_cache_dtype` values that store float8 E4M3 (vLLM's "fp8" and "fp8_e4m3").
FP8_KV_NAMES = ("fp8", "fp8_e4m3")
#: Checkpoint tensor names (after the attention module's name) of float8 KV scales; vLLM's
#: names. `kv_scale` is one scale for both K and V (older checkpoints).
KV_SCALE_SUFFIXES = ("k_scale", "v_scale", "kv_scale")


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool dtype of `kv_cache_dtype` `name`: the model dtype for "auto", float8 E4M3
    for "fp8" / "fp8_e4m3"; anything else is an `InvalidRequestError`."""
    if name == "auto":
        return dtype
    if name in FP8_KV_NAMES:
        return torch.float8_e4m3fn
    raise InvalidRequestError(
        f"kv_cache_dtype '{name}' is not one of auto, {', '.join(FP8_KV_NAMES)}",
        param="kv_cache_dtype",
    )


def kv_dtype_name(dtype: torch.dtype) -> str:
    """How logs and reports name a KV dtype: "bfloat16", "float32", "fp8_e4m3"."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


def checkpoint_kv_scales(
    module: torch.nn.Module, model_dir: str, num_layers: int, mapping: Any = None
) -> torch.Tensor | None:
    """The checkpoint's float8 KV scales as `[num_layers, 2]` float32 (K, V), matched to the
    KV pool's layers through the attention modules' names in KV order (`<name>.k_scale`,
    `<name>.v_scale`, or one `<name>.kv_scale` for both); None when the checkpoint has none.
    Scales for some layers only, or for modules the pool does not hold, are a
    `CheckpointError`."""
    from safetensors import safe_open

    rename = getattr(mapping, "rename", None)
    found: dict[str, float] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key.rsplit(".", 1)[-1] in KV_SCALE_SUFFIXES:
                    value = f.get_tensor(key).float()
                    if value.numel() != 1:
                        raise CheckpointError(
                            f"{path}: KV scale '{key}' has {value.numel()} elements; only "
                            "per-tensor KV scales are supported"
                        )
                    found[rename(key) if rename else key] = float(value.reshape(()))
    if not found:
        return None
    every = [n for n, m in module.named_modules() if isinstance(m, AttentionProjections)]
    # Attention modules past the pool's layers (an MTP head not drafting) keep no KV: their
    # scales are known names, not used.
    names = every[:num_layers]
    scales = torch.ones((num_layers, 2), dtype=torch.float32)
    used = set()
    for i, name in enumerate(names):
        both = found.get(f"{name}.kv_scale")
        k, v = found.get(f"{name}.k_scale", both), found.get(f"{name}.v_scale", both)
        if k is None or v is None:
            raise CheckpointError(
                f"{model_dir}: the checkpoint has KV scales but none for attention layer "
                f"'{name}' (k_scale and v_scale, or kv_scale); all layers or none"
            )
        scales[i, 0], scales[i, 1] = k, v
        used.update(f"{name}.{s}" for s in KV_SCALE_SUFFIXES)
    unused = {f"{n}.{s}" for n in every[num_layers:] for s in KV_SCALE_SUFFIXES}
    if len(names) != num_layers or set(found) - used - unused:
        extra = sorted(set(found) - used - unused)[:3]
        raise CheckpointError(
            f"{model_dir}: KV scales {extra or sorted(found)[:3]} do not match the model's "
            f"{num_layers} KV layers"
        )
    if not bool((scales > 0).all()) or not bool(torch.isfinite(scales).all()):
        raise CheckpointError(f"{model_dir}: KV scales must be finite and > 0")
    return scales


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Construct parameters directly in `dtype` (restores the previous default after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass
class LoadReport:
    """What loading took, for the startup summary and benchmark records."""

    weights_bytes: int
    kv_bytes: int
    num_kv_blocks: int
    load_seconds: float
    #: SSM slot pool and snapshot store (hybrid models): bytes, and live slots; 0 without
    #: recurrent layers.
    ssm_bytes: int = 0
    num_ssm_slots: int = 0
    #: CUDA start-up breakdown (weights, activations, KV, graphs); None on the CPU.
    breakdown: StartupBreakdown | None = None
    #: The weights' dtype in words (`fp8_weights.describe`), e.g. "bfloat16" or "fp8 e4m3
    #: (block 128x128 scales, from the checkpoint; 144 projections), bfloat16 elsewhere";
    #: what the start-up log and `/v1/models` report.
    weight_dtype: str = ""
    #: The KV pool's dtype (`kv_dtype_name`: "bfloat16", "float32", "fp8_e4m3"; what
    #: `/v1/models` reports) and where its float8 scales come from ("none" in the model
    #: dtype; "checkpoint", "calibrating" until the first prefill, then "calibrated").
    kv_cache_dtype: str = ""
    kv_scales: str = "none"
    #: KV blocks of `block_size` tokens one GiB holds at this dtype (the null block aside).
    kv_blocks_per_gib: int = 0


def _dummy_init(module: torch.nn.Module) -> None:
    """Small random weights that keep activations finite in any dtype (`--load-format dummy`)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(module.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:  # drawn where the parameter lives: an 8B model initialises in seconds
                gen = torch.Generator(device=p.device).manual_seed(i)
                p.uniform_(-0.02, 0.02, generator=gen)


def _kv_tiers(
    config: EngineConfig, model_dir: str, arch: str, kv: PagedKVCache, mtp: bool
) -> KvTiers:
    """The prefix cache's host / disk tiers; disk blocks are keyed to this checkpoint (its
    config.json and weight files' names and sizes) and this pool's shape and dtype."""
    h = hashlib.sha256()
    root = Path(model_dir)
    h.update((root / "config.json").read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    shape = (arch, str(kv.dtype), kv.block_size, kv.num_layers, kv.num_kv_heads, kv.head_dim, mtp)
    h.update(repr((shape, config.load_format, config.seed)).encode())
    tiers = KvTiers(
        host_bytes=int(config.kv_offload_host_gb * 2**30),
        disk_dir=config.kv_offload_disk,
        disk_bytes=int(config.kv_offload_disk_gb * 2**30),
        fingerprint=h.digest(),
    )
    logger.info(
        "KV offload: host tier %.2f GiB%s",
        config.kv_offload_host_gb,
        f", disk tier {config.kv_offload_disk_gb:.2f} GiB in {config.kv_offload_disk}"
        if config.kv_offload_disk is not None
        else "",
    )
    return tiers


def load_model(
    config: EngineConfig, model_dir: str, progress: LoadProgress | None = None
) -> tuple[TransformerModel, LoadReport]:
    """The model of `model_dir` built, loaded and sized for `config`; `progress` hears of
    each weight shard, then of KV sizing, graph capture and kernel warm-up."""
    progress = progress or NullProgress()
    try:
        return _load_model(config, model_dir, progress)
    finally:
        progress.close()


def _load_model(
    config: EngineConfig, model_dir: str, progress: LoadProgress
) -> tuple[TransformerModel, LoadReport]:
    start = time.perf_counter()
    raw = read_config_json(model_dir)
    source = str(Path(model_dir) / "config.json")
    arch_name, cls = resolve_architecture(raw.get("architectures"), raw.get("model_type"))
    mcfg = parse_model_config(raw, source)
    quant = parse_quantization(raw, source)  # an unsupported method fails here, before loading
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    max_model_len = config.max_model_len or mcfg.max_position_embeddings
    if max_model_len > mcfg.max_position_embeddings:
        raise InvalidRequestError(
            f"max_model_len {max_model_len} exceeds the checkpoint's max_position_embeddings "
            f"{mcfg.max_position_embeddings}",
            param="max_model_len",
        )
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
    if kv_dtype != dtype and config.batch_invariant:
        raise InvalidRequestError(
            "kv_cache_dtype fp8 is not supported by the batch-invariant CPU kernels",
            param="kv_cache_dtype",
        )
    draft = _draft_footprint(config, model_dir, mcfg, dtype, max_model_len)
    ops = kernels_for(device, batch_invariant=config.batch_invariant)
    fp8 = fp8_weights.plan(config, quant, device)
    with torch.device(device), _default_dtype(dtype):
        module = cls(mcfg, ops, max_model_len)
    module.eval()
    converted = 0
    if config.load_format == "dummy":
        progress.begin_phase("random weights")
        _dummy_init(module)
        if fp8 is not None:  # random float weights, quantized as an online load would
            converted = fp8_weights.convert(module, ops, fp8, quantize=True)
        progress.end_phase("random weights", "--load-format dummy")
    else:
        mapping = module.weight_mapping()
        if fp8 is not None and not fp8.online:  # the loader fills them as the checkpoint stores
            only = fp8_weights.quantized_targets(model_dir, mapping, quant)  # type: ignore[arg-type]
            converted = fp8_weights.convert(module, ops, fp8, quantize=False, only=only)
        absent = load_weights(module, model_dir, mapping, quant=quant, progress=progress)
        if absent:
            logger.info("checkpoint has no %s weights; dropped", ", ".join(sorted(absent)))
            module.drop_optional_weights(absent)
        if fp8 is not None and fp8.online:
            converted = fp8_weights.convert(module, ops, fp8, quantize=True)
        elif fp8 is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # float parts quantized on the way left cached blocks
    weight_dtype = fp8_weights.describe(dtype, fp8, converted, quant)
    logger.info("weights: %s", weight_dtype)
    # Counted at their stored bytes: FP8 weights take 1 byte each, so the KV budget (read
    # from the device's free memory) gets the rest.
    weights_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    ssm_specs = module.ssm_layer_specs() if hasattr(module, "ssm_layer_specs") else []
    ssm_pool = None
    if ssm_specs:
        ssm_pool = SsmSlotPool(ssm_specs, config.max_num_seqs, dtype, device)
    ssm_bytes = ssm_pool.bytes_total() if ssm_pool is not None else 0
    snapshot_slots = config.ssm_snapshot_slots if config.enable_prefix_caching else 0
    if ssm_pool is not None and snapshot_slots:
        # The snapshot store takes its memory from the KV budget, as the live slots do.
        ssm_bytes += SsmSlotPool.bytes_for(ssm_specs, snapshot_slots, dtype)
    breakdown = StartupBreakdown(
        weights_bytes=weights_bytes, load_seconds=time.perf_counter() - start
    )
    spec = config.speculative()
    mtp = spec is not None and spec.method == "mtp"
    if mtp:
        require_mtp_head(module, f"{model_dir} ({arch_name})")
    # The MTP head's KV layers follow the main model's, under the same block tables.
    kv_layers = module.kv_layer_count + (module.mtp.kv_layer_count if mtp else 0)
    per_block = PagedKVCache.bytes_per_block(
        kv_layers, config.block_size, mcfg.num_key_value_heads, mcfg.head_dim, kv_dtype
    )
    kv_scales = None
    if kv_dtype != dtype:
        if config.load_format != "dummy":
            kv_scales = checkpoint_kv_scales(module, model_dir, kv_layers, module.weight_mapping())
        if kv_scales is None and config.kv_offload_disk is not None:
            raise InvalidRequestError(
                "kv_cache_dtype fp8 with calibrated scales cannot use the disk KV tier: the "
                "scales differ between runs, so blocks stored by one run would decode wrongly "
                "in the next; use a checkpoint with k_scale/v_scale or no --kv-offload-disk",
                param="kv_cache_dtype",
            )
    progress.begin_phase("KV sizing")
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        budget = kv_budget_bytes(
            config, mcfg, module, device, dtype, max_model_len, ssm_bytes, breakdown,
            hybrid=ssm_pool is not None,
        )  # fmt: skip
        if draft is not None:
            # The draft's weights (loaded after this pool) and its pool of as many blocks.
            if device.type == "cuda":
                budget -= draft.weights_bytes
            num_blocks = _blocks_in_budget(
                config, per_block + draft.per_block, max_model_len, budget
            )
        else:
            num_blocks = _blocks_in_budget(config, per_block, max_model_len, budget)
        if config.lora_enabled and device.type == "cuda":
            # The LoRA slots are allocated after the pool: leave room for them.
            lora_bytes = lora_slot_bytes(module, config.max_loras, config.max_lora_rank, dtype)
            num_blocks = max(2, num_blocks - -(-lora_bytes // per_block))
    kv = PagedKVCache(
        kv_layers, num_blocks, config.block_size, mcfg.num_key_value_heads,
        mcfg.head_dim, kv_dtype, device,
    )  # fmt: skip
    if kv_scales is not None:
        kv.set_scales(kv_scales.to(device))
    model = TransformerModel(
        module, mcfg, kv, device, dtype, max_model_len, config.enable_prefix_caching, ssm_pool,
        mtp=mtp, ssm_snapshot_slots=snapshot_slots,
    )  # fmt: skip
    model.kernel_implementations = dict(ops.implementations)
    model.kernel_ops = ops
    if model.snapshots is not None:
        gap = config.ssm_snapshot_min_gap_tokens
        if gap is None:
            gap = 512 if device.type == "cuda" else NEAR_BLOCKS * model.block_size
        model.snapshot_min_gap_tokens = gap
    if config.high_speed_swap:
        if config.preemption_mode != "recompute" or config.speculative() is not None:
            raise InvalidRequestError(
                "high_speed_swap works with preemption_mode recompute and without speculative "
                "decoding (their records and rollbacks read device blocks only)",
                param="high_speed_swap",
            )
        model.attach_high_speed_swap(config.high_speed_swap_blocks_per_seq)
    if config.kv_offload_host_gb > 0 or config.kv_offload_disk is not None:
        model.attach_kv_tiers(_kv_tiers(config, model_dir, arch_name, kv, mtp))
    if config.lora_enabled:
        model.enable_lora(config.max_loras, config.max_lora_rank, config.resolved_max_cpu_loras)
        for name, path in config.lora_module_dirs().items():
            model.load_lora(name, path)
    kv_bytes = num_blocks * per_block
    breakdown.kv_bytes = kv_bytes
    progress.end_phase(
        "KV sizing",
        f"{num_blocks - 1} usable blocks x {config.block_size} tokens ({human_bytes(kv_bytes)}"
        f"{', set by num_kv_blocks' if config.num_kv_blocks is not None else ''})",
    )
    if device.type == "cuda" and not config.enforce_eager:
        progress.begin_phase("graph capture")
        _capture_graphs(model, config, max_model_len, breakdown, ops.implementations)
        progress.end_phase("graph capture", human_bytes(breakdown.graph_bytes))
    if device.type == "cuda":
        progress.begin_phase("kernel warm-up")
        warm = warm_forward_shapes(model, config.max_num_seqs)
        progress.end_phase("kernel warm-up", f"{config.max_num_seqs} rows")
        logger.info("prefill and mixed-batch kernels compiled for the common shapes in %.1fs", warm)
    if kv.quantized and kv_scales is None:
        # After every warm-up forward: the first real prefill sets the scales.
        kv.arm_calibration()
    report = LoadReport(
        weights_bytes, kv_bytes, num_blocks, time.perf_counter() - start, ssm_bytes,
        ssm_pool.num_slots if ssm_pool is not None else 0, breakdown, weight_dtype,
        kv_cache_dtype=kv_dtype_name(kv_dtype), kv_scales=kv.scales_source,
        kv_blocks_per_gib=2**30 // per_block,
    )  # fmt: skip
    logger.info(
        "KV cache dtype %s (kv_cache_dtype %s)%s: %d bytes per block of %d tokens, %d blocks "
        "per GiB",
        kv_dtype_name(kv_dtype), config.kv_cache_dtype,
        {
            "none": "", "checkpoint": ", per-layer scales from the checkpoint",
            "calibrating": ", per-layer scales calibrated on the first prefill (amax / 448)",
        }.get(kv.scales_source, f", scales {kv.scales_source}"),
        per_block, config.block_size, report.kv_blocks_per_gib,
    )  # fmt: skip
    if ssm_pool is not None:
        logger.info(
            "SSM slot pool: %d slots x %d recurrent layers (%.1f MiB, float32 state)",
            ssm_pool.num_slots, len(ssm_specs), ssm_pool.bytes_total() / 2**20,
        )  # fmt: skip
        if model.snapshots is not None:
            logger.info(
                "SSM snapshot store: %d slots x %.2f MiB (%.1f MiB) for hybrid prefix caching",
                model.snapshots.num_slots, model.snapshots.bytes_per_snapshot / 2**20,
                model.snapshots.bytes_total() / 2**20,
            )  # fmt: skip
    logger.info(
        "loaded %s (%s) on %s/%s: weights %.1f MiB (%s), KV %s %d usable blocks (+1 null, "
        "%.1f MiB, %d blocks/GiB) in %.2fs",
        model_dir, arch_name, device, str(dtype).removeprefix("torch."), weights_bytes / 2**20,
        weight_dtype, kv_dtype_name(kv_dtype), num_blocks - 1, kv_bytes / 2**20,
        report.kv_blocks_per_gib, report.load_seconds,
    )  # fmt: skip
    if device.type == "cuda":
        logger.info("startup: %s; total %.1fs", breakdown.summary(), report.load_seconds)
    return model, report


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
    with torch.device("meta"), _default_dtype(dtype):
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
    with torch.device(device), _default_dtype(dtype):
        module = cls(mcfg, ops, max_model_len)
    module.eval()
    _refuse_hybrid_draft(module, draft_dir)
    quant = parse_quantization(raw, str(Path(draft_dir) / "config.json"))
    if load_format == "dummy":
        _dummy_init(module)
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


def _capture_graphs(
    model: TransformerModel,
    config: EngineConfig,
    max_model_len: int,
    breakdown: StartupBreakdown,
    kernels: dict[str, str],
) -> None:
    """Capture decode graphs when every op on the decode path is capturable. Hybrid models
    need the Triton recurrent decode ops (they skip the padding rows' slot -1; the references
    cannot) and get no verify graphs (their verify runs token by token, eagerly)."""
    hybrid = model.ssm_pool is not None
    eager_recurrent = [
        op for op in RECURRENT_DECODE_OPS if not kernels.get(op, "").startswith("triton")
    ]
    if not kernels.get("paged_attention", "").startswith("triton"):
        reason = "the attention op is not capturable"
    elif hybrid and eager_recurrent:
        reason = f"recurrent layers use reference ops ({', '.join(eager_recurrent)})"
    elif _has_moe(model) and not all(
        kernels.get(op, "").startswith("triton") for op in ("moe_experts", "moe_softmax_experts")
    ):
        # The reference grouped experts read the per-expert counts on the host.
        reason = "the MoE experts op is the torch reference, which syncs with the host"
    elif model.hss is not None:
        reason = "high-speed swap gathers host blocks per layer"
    else:
        reason = ""
    if reason:
        logger.warning("CUDA graphs disabled: %s; decode runs eagerly (slower)", reason)
        return
    spec = config.speculative()
    # Verify steps of k drafts replay their own graphs (k + 1 token rows per sequence).
    query_lens = (1,) if spec is None else (1, spec.num_speculative_tokens + 1)
    if hybrid and spec is not None:
        query_lens = (1,)
        logger.warning(
            "speculative verify steps of a hybrid model run eagerly (no verify graphs: the "
            "recurrent layers verify token by token); decode steps are graphed"
        )
    runner = DecodeGraphRunner(
        model.module, model.main_kv_layers, model.device, config.max_num_seqs,
        blocks_for(max_model_len, config.block_size), config.block_size, query_lens,
        head_hidden=model.mtp_enabled, lora=model.lora.slots if model.lora is not None else None,
        ssm_layers=model.ssm_pool.layers if model.ssm_pool is not None else None,
    )  # fmt: skip
    runner.capture()
    model.graph_runner = runner
    breakdown.graph_bytes = runner.capture_bytes
    breakdown.capture_seconds = runner.capture_seconds
    if model.mtp_enabled and spec is not None:
        head = MtpGraphRunner(
            model.module, model.head_kv_layers, model.device, model.dtype,
            config.max_num_seqs, blocks_for(max_model_len, config.block_size),
            config.block_size, spec.num_speculative_tokens,
        )  # fmt: skip
        head.capture()
        model.mtp_graphs[head.k] = head
        breakdown.graph_bytes += head.capture_bytes
        breakdown.capture_seconds += head.capture_seconds
    if runner.capture_bytes > GRAPH_RESERVE_BYTES:
        logger.warning(
            "decode graphs took %.0f MiB, more than the %.0f MiB reserved for them",
            runner.capture_bytes / 2**20, GRAPH_RESERVE_BYTES / 2**20,
        )  # fmt: skip


def _has_moe(model: TransformerModel) -> bool:
    return any(isinstance(m, FusedExperts) for m in model.module.modules())


def _blocks_in_budget(config: EngineConfig, per_block: int, max_model_len: int, budget: int) -> int:
    """KV blocks (the null block included) that `budget` bytes hold, capped at what
    `max_num_seqs` sequences of `max_model_len` tokens can use; at least one such sequence."""
    blocks_per_seq = blocks_for(max_model_len, config.block_size)
    wanted = config.max_num_seqs * blocks_per_seq + 1
    blocks = min(max(budget // per_block, 0), wanted)
    if blocks < blocks_per_seq + 1:
        raise CheckpointError(
            f"the KV budget holds {blocks} blocks of {config.block_size} tokens, fewer than one "
            f"sequence of max_model_len {max_model_len} needs ({blocks_per_seq + 1}); lower "
            "max_model_len or raise the KV memory budget"
        )
    return blocks
