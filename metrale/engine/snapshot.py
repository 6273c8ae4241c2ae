"""What an engine handle reports: `EngineSnapshot` (the gauges and counters `/metrics` reads)
and `EngineInfo` (what the server needs to know of the loaded model), and the readers that
take them off an `Engine`.

Owner: engine. Both transports (`AsyncEngine`, `EngineProcess`) take snapshots with
`SnapshotTaker` on the thread or process that runs the `Engine`, and hand them to the server.

Invariants:
- `EngineSnapshot` and `EngineInfo` are picklable (they cross `EngineProcess`'s pipe): plain
  values and copies, never live engine objects.
- `SnapshotTaker.take` runs on the engine's own thread (it reads the scheduler's queues).
- The prefix cache's cache-only block count is walked at most every `_CACHE_SCAN_INTERVAL_S`
  while busy, and exactly whenever the engine is idle.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from metrale.sampling.defaults import SamplingDefaults
from metrale.scheduler.core import SchedulerStats
from metrale.spec.stats import SpecStats

if TYPE_CHECKING:
    from metrale.engine.engine import Engine

#: Least time between two walks of the prefix cache for the cache-only block count while busy.
_CACHE_SCAN_INTERVAL_S = 0.25


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges and counters as of the last loop turn (read by `/metrics`)."""

    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_requests: int = 0
    num_free_blocks: int = 0
    #: Blocks held only by the prefix cache (reclaimable on demand; refreshed at most every
    #: `_CACHE_SCAN_INTERVAL_S` while busy, exactly whenever the engine is idle).
    num_cache_only_blocks: int = 0
    num_total_blocks: int = 0
    num_steps: int = 0
    #: Steps launched on the device token feed / fed-eligible steps drained first.
    fed_steps: int = 0
    drained_steps: int = 0
    late_sampled_steps: int = 0
    alive: bool = True
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    #: The model's prefix-cache counters (`Model.prefix_cache_stats`: evictions, bypasses).
    prefix_cache: dict[str, int] = field(default_factory=dict)
    #: Forwards replayed from a CUDA graph, and forwards run eagerly.
    graph_forwards: int = 0
    eager_forwards: int = 0
    #: Speculative decoding counters (`Engine.spec_stats`; all zero when speculation is off).
    spec: SpecStats = field(default_factory=SpecStats)
    #: The throughput gate's switch counts (`SpecGate.counters`: global_off, global_on,
    #: row_off, row_on); empty when there is no gate.
    spec_gate: dict[str, int] = field(default_factory=dict)
    #: Drafts per verify row (k); 0 when speculation is off.
    num_speculative_tokens: int = 0
    #: LoRA slot pool gauges and counters (`Engine.lora_stats`); empty when LoRA is off.
    lora: dict[str, int] = field(default_factory=dict)
    #: The sampler's path counters (`Sampler.stats`: batches by path, re-routed rows,
    #: full-row batches by reason).
    sampler: dict[str, int] = field(default_factory=dict)
    #: The CPU projections' calls by path (`gemv`, `onednn`, `torch`, and `gemv_unavailable`
    #: for few-row batches the C kernel would have run; `kernels.cpu_linear`); empty off the CPU.
    cpu_projections: dict[str, int] = field(default_factory=dict)
    #: Forwards the CPU's fused decode step ran (`kernels.cpu_decode`; a subset of
    #: `eager_forwards`); None when the model has no fused step.
    cpu_fused_decode_forwards: int | None = None
    #: Forwards a served CPU engine ran on every core (`cpu_threads.CpuThreadGovernor`); None
    #: without the governor.
    cpu_forwards_all_cores: int | None = None


class SnapshotTaker:
    """Reads an `Engine`'s gauges into an `EngineSnapshot` (on the engine's own thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cache_only = 0
        self._cache_scanned_at = float("-inf")

    def take(self, alive: bool = True) -> EngineSnapshot:
        engine = self.engine
        scheduler = engine.scheduler
        counters = engine.model.forward_counters()
        return EngineSnapshot(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped),
            num_requests=len(engine.requests),
            num_free_blocks=engine.model.num_free_blocks(),
            num_cache_only_blocks=self._cache_only_blocks(idle=not engine.requests),
            num_total_blocks=engine.model.num_total_blocks(),
            num_steps=engine.num_steps,
            fed_steps=engine.fed_steps,
            drained_steps=engine.drained_steps,
            late_sampled_steps=engine.late_sampled_steps,
            alive=alive,
            stats=copy.deepcopy(scheduler.stats),
            prefix_cache=dict(engine.model.prefix_cache_stats()),
            graph_forwards=counters.get("graph_forwards", 0),
            eager_forwards=counters.get("eager_forwards", 0),
            spec=copy.deepcopy(engine.spec_stats),
            spec_gate=dict(engine.speculation.gate.counters) if engine.speculation.gate else {},
            sampler=dict(engine.sampler.stats),
            num_speculative_tokens=engine.speculation.k,
            lora=engine.lora_stats(),
            cpu_projections={
                k.removeprefix("cpu_projection_"): v
                for k, v in counters.items()
                if k.startswith("cpu_projection_")
            },
            cpu_fused_decode_forwards=counters.get("cpu_fused_decode_forwards"),
            cpu_forwards_all_cores=(
                engine.cpu_threads.forwards_at_top if engine.cpu_threads is not None else None
            ),
        )

    def _cache_only_blocks(self, idle: bool) -> int:
        now = time.monotonic()
        if idle or now - self._cache_scanned_at >= _CACHE_SCAN_INTERVAL_S:
            self._cache_only = int(self.engine.model.cache_only_blocks())
            self._cache_scanned_at = now
        return self._cache_only


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of a loaded engine (picklable: it crosses processes)."""

    served_model_name: str
    model_dir: str
    max_model_len: int
    device: str
    dtype: str
    num_total_blocks: int
    kv_block_size: int
    #: The checkpoint's generation_config.json sampling defaults (empty when not used).
    sampling_defaults: SamplingDefaults
    #: `EngineConfig.scheduling_policy` ("fcfs" or "priority").
    scheduling_policy: str = "fcfs"
    #: LoRA adapters registered at start-up, (name, id, directory); None: LoRA is off.
    lora_adapters: tuple[tuple[str, int, str], ...] | None = None
    #: The engine's `VisionPrompts` (images -> prompt tokens; no model inside, picklable);
    #: None for a text-only model.
    vision: Any = None
    #: The weights' dtype in words (`LoadReport.weight_dtype`, e.g. "fp8 e4m3 (block 128x128
    #: scales, from the checkpoint; 252 projections), bfloat16 elsewhere"); "" when unknown.
    weight_dtype: str = ""
    #: The KV pool's dtype (`LoadReport.kv_cache_dtype`: "bfloat16", "fp8_e4m3", ...); "" when
    #: unknown.
    kv_cache_dtype: str = ""


def engine_info(engine: Engine) -> EngineInfo:
    model = engine.model
    return EngineInfo(
        served_model_name=engine.served_model_name,
        model_dir=engine.model_dir,
        max_model_len=engine.max_model_len,
        device=model.device_name() or engine.config.device,
        dtype=model.dtype_name() or engine.config.dtype,
        num_total_blocks=model.num_total_blocks(),
        kv_block_size=model.kv_block_size() or 0,
        sampling_defaults=engine.sampling_defaults,
        scheduling_policy=engine.config.scheduling_policy,
        lora_adapters=tuple(engine.lora_adapter_list()) if engine.config.lora_enabled else None,
        vision=engine.vision,
        weight_dtype=getattr(engine.load_report, "weight_dtype", "") or "",
        kv_cache_dtype=getattr(engine.load_report, "kv_cache_dtype", "") or "",
    )
