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
  pool (`draft_factory.load_draft_model`: as many blocks as the target's) never overcommits
  memory either. Device, dtype and KV-dtype resolution live in `load_setup`.
- The KV pool's dtype is `kv_cache_dtype` (`resolve_kv_dtype`): the model dtype, or float8
  E4M3 whose block bytes (and so the blocks a budget holds) follow the float8 element size.
  A float8 pool takes its per-layer scales from the checkpoint (`k_scale` / `v_scale` /
  `kv_scale` under each attention module, all layers or none) or, lacking them, is armed
  to calibrate on the first prefill after the warm-up forwards (`metrale.cache.kv_cache`).
  A draft model's pool stays in the model dtype.
- Tensor parallel (`sharding`, a `ModelSharding` from `metrale.distributed`): every rank runs
  this same load, in lockstep. The module is built from the rank's local config (its heads,
  widths, vocabulary), cut (`prepare`) before its weights load, reads only its slices of
  the checkpoint, and is wrapped (`wrap`) before the `TransformerModel` sees it; the pool
  holds the rank's KV heads and as many blocks as the smallest rank's budget
  (`agree_blocks`); decode graphs are not captured (logged).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from metrale.cache.block_pool import blocks_for
from metrale.cache.kv_cache import PagedKVCache
from metrale.cache.kv_tiers import KvTiers
from metrale.cache.ssm_pool import SsmSlotPool
from metrale.config import EngineConfig
from metrale.errors import CheckpointError, InvalidRequestError
from metrale.kernels import kernels_for
from metrale.layers.moe import FusedExperts
from metrale.model_config import ModelConfig
from metrale.model_engine import fp8_weights
from metrale.model_engine.cuda_graphs import RECURRENT_DECODE_OPS, DecodeGraphRunner
from metrale.model_engine.draft_factory import _draft_footprint
from metrale.model_engine.gpu_setup import (
    GRAPH_RESERVE_BYTES,
    StartupBreakdown,
    kv_budget_bytes,
    warm_forward_shapes,
)
from metrale.model_engine.load_setup import (
    checkpoint_kv_scales,
    default_dtype,
    dummy_init,
    kv_dtype_name,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from metrale.model_engine.lora import lora_slot_bytes
from metrale.model_engine.mtp import require_mtp_head
from metrale.model_engine.mtp_graphs import MtpGraphRunner
from metrale.model_engine.ssm_prefix import NEAR_BLOCKS
from metrale.model_engine.transformer_model import TransformerModel
from metrale.models.config import parse_model_config, read_config_json
from metrale.models.loader import load_weights
from metrale.models.quantization import parse_quantization
from metrale.models.registry import resolve_architecture
from metrale.progress import LoadProgress, NullProgress, human_bytes

logger = logging.getLogger(__name__)


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


class ModelSharding(Protocol):
    """One tensor-parallel rank's part in loading (`metrale.distributed.launch.RankSharding`)."""

    def local_config(self, mcfg: ModelConfig) -> ModelConfig:
        """The config this rank's module is built from (checks that the model divides)."""

    def prepare(self, module: nn.Module) -> None:
        """Cut the freshly built module (before its weights load)."""

    def read(self, name: str, handle: Any) -> tuple[str, torch.Tensor] | None:
        """This rank's part of a checkpoint tensor (`loader.TensorReader`)."""

    def wrap(self, module: nn.Module) -> nn.Module:
        """The loaded module as the engine calls it."""

    def agree_blocks(self, blocks: int) -> int:
        """The KV block count every rank can hold (the smallest of the ranks' `blocks`)."""


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
    config: EngineConfig,
    model_dir: str,
    progress: LoadProgress | None = None,
    *,
    sharding: ModelSharding | None = None,
) -> tuple[TransformerModel, LoadReport]:
    """The model of `model_dir` built, loaded and sized for `config`; `progress` hears of
    each weight shard, then of KV sizing, graph capture and kernel warm-up. `sharding`: this
    process is one rank of a tensor-parallel world (`metrale.distributed.launch`)."""
    progress = progress or NullProgress()
    if config.tensor_parallel_size > 1 and sharding is None:
        raise InvalidRequestError(
            f"tensor_parallel_size {config.tensor_parallel_size}: load through "
            "metrale.distributed.launch.load_tensor_parallel (the engine does)",
            param="tensor_parallel_size",
        )
    try:
        return _load_model(config, model_dir, progress, sharding)
    finally:
        progress.close()


def _load_model(
    config: EngineConfig, model_dir: str, progress: LoadProgress, sharding: ModelSharding | None
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
    # A tensor-parallel rank builds its share: its heads, widths and vocabulary rows.
    rank_cfg = sharding.local_config(mcfg) if sharding is not None else mcfg
    with torch.device(device), default_dtype(dtype):
        module = cls(rank_cfg, ops, max_model_len)
        if sharding is not None:
            sharding.prepare(module)
    module.eval()
    converted = 0
    if config.load_format == "dummy":
        progress.begin_phase("random weights")
        dummy_init(module)
        if fp8 is not None:  # random float weights, quantized as an online load would
            converted = fp8_weights.convert(module, ops, fp8, quantize=True)
        progress.end_phase("random weights", "--load-format dummy")
    else:
        mapping = module.weight_mapping()
        if fp8 is not None and not fp8.online:  # the loader fills them as the checkpoint stores
            only = fp8_weights.quantized_targets(model_dir, mapping, quant)  # type: ignore[arg-type]
            converted = fp8_weights.convert(module, ops, fp8, quantize=False, only=only)
        absent = load_weights(
            module, model_dir, mapping, quant=quant, progress=progress,
            reader=sharding.read if sharding is not None else None,
        )  # fmt: skip
        if absent:
            logger.info("checkpoint has no %s weights; dropped", ", ".join(sorted(absent)))
            module.drop_optional_weights(absent)
        if fp8 is not None and fp8.online:
            converted = fp8_weights.convert(module, ops, fp8, quantize=True)
        elif fp8 is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # float parts quantized on the way left cached blocks
    if sharding is not None:
        module = sharding.wrap(module)
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
        kv_layers, config.block_size, rank_cfg.num_key_value_heads, mcfg.head_dim, kv_dtype
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
            config, rank_cfg, module, device, dtype, max_model_len, ssm_bytes, breakdown,
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
        if sharding is not None:
            num_blocks = sharding.agree_blocks(num_blocks)
    kv = PagedKVCache(
        kv_layers, num_blocks, config.block_size, rank_cfg.num_key_value_heads,
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
    if device.type == "cpu" and sharding is None:
        from metrale.model_engine import cpu_fused_decode

        if config.batch_invariant:  # its ops (fixed GEMM tiles) must run every forward
            logger.info("kernels: CPU decode layer by layer (batch_invariant)")
        else:
            model.cpu_decode = cpu_fused_decode.build(module, model.main_kv_layers)
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
    if device.type == "cuda" and not config.enforce_eager and sharding is not None:
        logger.warning(
            "CUDA graphs disabled: tensor parallel decode runs eagerly on every rank (graphs "
            "on every rank are not built yet; slower)"
        )
    elif device.type == "cuda" and not config.enforce_eager:
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
