"""The engine-side metric families a scrape yields beyond the basic gauges: data-parallel
replicas, LoRA, the KV offload tiers, the hybrid prefix cache's snapshots and speculative
decoding. Each is a generator of `prometheus_client` families read from an
`EngineSnapshot` (or a replica's stats) at scrape time.

Owner: server (`metrale.server.metrics`'s collector is the one caller). The series' names and
label bounds are the invariants stated in `metrale.server.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from metrale.cache.ssm_snapshots import MISS_CAUSES
from metrale.engine.async_engine import EngineSnapshot
from metrale.engine.replicas import ReplicaStats


def by_label(name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    """A counter family with one series per `label` value, in `values`' order."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in values.items():
        family.add_metric([value], count)
    return family


def replica_metrics(replicas: list[ReplicaStats]) -> Iterator[Metric]:
    """Per data-parallel replica (`replica` label: its index): liveness, load, what the
    router sent it and why, and its own engine's prefix-cache hits."""

    def family(kind: type, name: str, doc: str, value: Callable[[ReplicaStats], float]) -> Metric:
        metric = kind(name, doc, labels=["replica"])
        for r in replicas:
            metric.add_metric([str(r.index)], value(r))
        return metric

    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield family(gauge, "metrale_dp_replica_alive", "1 while the replica takes requests",
                 lambda r: float(r.alive))  # fmt: skip
    yield family(gauge, "metrale_dp_replica_open_requests", "requests in flight on the replica",
                 lambda r: r.open_requests)  # fmt: skip
    yield family(gauge, "metrale_dp_replica_requests_running", "sequences running (holding KV)",
                 lambda r: r.snapshot.num_running)  # fmt: skip
    yield family(gauge, "metrale_dp_replica_kv_blocks_free", "free KV cache blocks",
                 lambda r: r.snapshot.num_free_blocks)  # fmt: skip
    yield family(counter, "metrale_dp_replica_restarts", "restarts of the replica's engine",
                 lambda r: r.restarts)  # fmt: skip
    yield family(counter, "metrale_dp_replica_prefix_cache_hit_tokens",
                 "prompt tokens the replica reused from its prefix cache",
                 lambda r: r.snapshot.stats.prefix_hit_tokens)  # fmt: skip
    yield family(counter, "metrale_dp_routed_matched_tokens",
                 "prompt tokens the router expected the replica's cache to hold",
                 lambda r: r.routed_matched_tokens)  # fmt: skip
    yield family(gauge, "metrale_dp_router_recorded_blocks",
                 "block hashes the router remembers sending to the replica",
                 lambda r: r.recorded_blocks)  # fmt: skip
    routed = CounterMetricFamily(
        "metrale_dp_requests_routed",
        "requests sent to the replica, by reason (prefix: it held the longest cached prefix; "
        "load: the least loaded)",
        labels=["replica", "reason"],
    )
    for r in replicas:
        routed.add_metric([str(r.index), "prefix"], r.routed_prefix)
        routed.add_metric([str(r.index), "load"], r.routed_load)
    yield routed


def lora_metrics(snap: EngineSnapshot) -> Iterator[Metric]:
    """The LoRA slot pool's gauges and counters; none when LoRA is off."""
    lora = snap.lora
    if not lora:
        return
    for name, doc, key in (
        ("metrale_lora_slots", "device LoRA slots (--max-loras)", "slots"),
        ("metrale_lora_adapters_resident", "adapters resident in a device slot", "resident"),
        ("metrale_lora_adapters_registered", "adapters the engine serves", "registered"),
        (
            "metrale_lora_requests_waiting_for_slot",
            "sequences the last admission pass left waiting for a LoRA slot",
            "waiting_for_slot",
        ),
    ):
        yield GaugeMetricFamily(name, doc, value=lora.get(key, 0))
    for name, doc, key in (
        ("metrale_lora_promotions", "adapters copied into a device slot", "promotions"),
        ("metrale_lora_evictions", "adapters evicted from a device slot (LRU)", "evictions"),
        ("metrale_lora_disk_loads", "promotions that read the adapter from disk", "disk_loads"),
    ):
        yield CounterMetricFamily(name, doc, value=lora.get(key, 0))


def offload_metrics(cache: dict[str, int]) -> Iterator[Metric]:
    """The prefix cache's host / disk tiers (`--kv-offload-*`; zeros when off)."""
    families = (
        ("blocks", "KV blocks held by each offload tier", GaugeMetricFamily),
        ("bytes", "bytes held by each offload tier", GaugeMetricFamily),
        ("hits", "evicted KV blocks found again in each offload tier", CounterMetricFamily),
        ("evictions", "blocks leaving each offload tier (host: to disk; disk: dropped)",
         CounterMetricFamily),
        ("restore_bytes", "bytes brought back from each offload tier into device blocks",
         CounterMetricFamily),
    )  # fmt: skip
    for name, doc, kind in families:
        family = kind(f"metrale_kv_offload_{name}", doc, labels=["tier"])
        for tier in ("host", "disk"):
            family.add_metric([tier], cache.get(f"offload_{tier}_{name}", 0))
        yield family
    yield by_label(
        "metrale_kv_offload_restore_seconds",
        "host wall time of restoring blocks from each offload tier (restore_bytes over this: "
        "the restore bandwidth)",
        "tier",
        {tier: cache.get(f"offload_{tier}_restore_us", 0) / 1e6 for tier in ("host", "disk")},
    )
    yield CounterMetricFamily(
        "metrale_kv_offload_corrupt",
        "disk-tier block files refused (bad header or checksum); their blocks are recomputed",
        value=cache.get("offload_corrupt", 0),
    )


#: The SSM snapshot store's single-value series: (family, name suffix, help, stats key).
SNAPSHOT_SERIES = (
    (GaugeMetricFamily, "slots_used",
     "SSM snapshot store slots holding a snapshot (hybrid prefix caching)", "slots_used"),
    (GaugeMetricFamily, "slots_total",
     "SSM snapshot store slots (--ssm-snapshot-slots; 0 without a store)", "slots"),
    (GaugeMetricFamily, "bytes_used",
     "bytes of the SSM snapshot store's slots holding a snapshot", "bytes_used"),
    (GaugeMetricFamily, "bytes_per_slot",
     "bytes of one SSM snapshot (every recurrent layer's conv and SSM state)", "bytes_per_slot"),
    (CounterMetricFamily, "hits", "hybrid prefix lookups that restored an SSM snapshot", "hits"),
    (CounterMetricFamily, "captures",
     "SSM snapshots taken (two-phase prefill points, decode tracks)", "captures"),
    (CounterMetricFamily, "captures_skipped",
     "SSM snapshots not taken: the store was full of worthier or in-use snapshots",
     "captures_skipped"),
    (CounterMetricFamily, "evictions",
     "SSM snapshots evicted under store pressure (Marconi utility)", "evictions"),
)  # fmt: skip


def snapshot_metrics(cache: dict[str, int]) -> Iterator[Metric]:
    """The SSM snapshot store of hybrid models' prefix cache (zero on other models)."""
    for family, suffix, doc, key in SNAPSHOT_SERIES:
        yield family(
            f"metrale_ssm_snapshot_{suffix}", doc, value=cache.get(f"ssm_snapshot_{key}", 0)
        )
    yield by_label(
        "metrale_ssm_snapshot_misses",
        "hybrid prefix lookups that reused nothing, by cause (cold: nothing cached; "
        "no_snapshot: KV cached without a state; evicted: its snapshot was evicted; "
        "wrong_adapter: only another adapter or tenant holds it)",
        "cause",
        {cause: cache.get(f"ssm_snapshot_miss_{cause}", 0) for cause in MISS_CAUSES},
    )


def spec_metrics(snap: EngineSnapshot) -> Iterator[Metric]:
    """Speculative decoding's counters (`SpecStats`, `SpecGate.counters`), vLLM's names."""
    spec = snap.spec
    yield CounterMetricFamily(
        "metrale_spec_decode_num_drafts",
        "verify rows that carried at least one draft token",
        value=spec.num_drafts,
    )
    yield CounterMetricFamily(
        "metrale_spec_decode_num_draft_tokens", "draft tokens verified", value=spec.num_draft_tokens
    )
    yield CounterMetricFamily(
        "metrale_spec_decode_num_accepted_tokens",
        "draft tokens accepted",
        value=spec.num_accepted_tokens,
    )
    per_pos = CounterMetricFamily(
        "metrale_spec_decode_num_accepted_tokens_per_pos",
        "verify rows whose draft at this 0-based position was accepted",
        labels=["position"],
    )
    counts = list(spec.accepted_per_pos)
    counts += [0] * (snap.num_speculative_tokens - len(counts))
    for position, count in enumerate(counts):
        per_pos.add_metric([str(position)], count)
    yield per_pos
    yield CounterMetricFamily(
        "metrale_spec_decode_verify_steps",
        "engine steps that verified drafts",
        value=spec.verify_steps,
    )
    yield CounterMetricFamily(
        "metrale_spec_decode_drained_steps",
        "steps read back before planning because a row could speculate (drafts need every "
        "token known; also counted in metrale_engine_drained_steps)",
        value=spec.drained_for_spec,
    )
    switches = CounterMetricFamily(
        "metrale_spec_decode_gate_switches",
        "throughput gate switches of speculation, per batch-width bucket (global) or per row",
        labels=["scope", "to"],
    )
    for scope in ("global", "row"):
        for to in ("on", "off"):
            switches.add_metric([scope, to], snap.spec_gate.get(f"{scope}_{to}", 0))
    yield switches
