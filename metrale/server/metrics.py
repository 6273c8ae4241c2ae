"""Prometheus metrics of one server: HTTP traffic, tokens, latencies, engine gauges.

Owner: server. `ServerMetrics` owns a private `CollectorRegistry` (never the global default
one), so several apps in one process do not collide. HTTP counters are updated by the
middleware, token counts and latencies by `RequestTracker`s, and engine gauges/counters are
read from the engine handle's `snapshot()` at scrape time (speculative decoding's included).

Invariants:
- Every series is named `metrale_*`; counters end in `_total` when exposed.
- `metrale_model_info` is one series of value 1 whose labels (`model`, `dtype`, `device`)
  name what is served; the dashboard (`metrale top`) reads the dtype there.
- Label values are bounded: `endpoint` is one of the known routes or "other", `status` an
  HTTP status code, `reason` a finish reason, `position` a draft slot below k (at most 16),
  `scope` and `to` the gate's two scopes and two directions.
- A request is counted once in `metrale_requests_total`, with the status it answered (499 for
  a client that left first).
- A client that leaves before its answer is complete is a client abort, not an error: counted
  once in `metrale_client_aborts_total{stage}` ("body": while sending its body, "queue": before
  its first token, queued or in prefill, "stream": after it) and logged at INFO.
- The speculative decoding series (`metrale_spec_decode_*`, vLLM's names) are always exposed,
  zero when speculation is off; the per-position series has one `position` per draft slot
  (0..k-1), none when speculation is off.
- With data-parallel replicas, the engine series are their sums (`ReplicatedEngine.snapshot`)
  and the `metrale_dp_*` series give each replica's own (`replica` label: its index, so
  bounded by `--data-parallel-size`); without, there are no `metrale_dp_*` series.
- The LoRA series (`metrale_lora_*`: slots, adapters resident and registered, sequences
  waiting for a slot, promotions, evictions, disk loads) exist only when LoRA is on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from metrale.engine.async_engine import EngineHandle
from metrale.server.metric_families import (
    by_label,
    lora_metrics,
    offload_metrics,
    replica_metrics,
    snapshot_metrics,
    spec_metrics,
)

logger = logging.getLogger(__name__)
#: The stages at which a client abort is counted (`metrale_client_aborts_total{stage}`).
ABORT_STAGES = ("body", "queue", "stream")

KNOWN_ENDPOINTS = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/version",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


def endpoint_label(path: str) -> str:
    return path if path in KNOWN_ENDPOINTS else "other"


class _EngineCollector(Collector):
    def __init__(self, engine: EngineHandle, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        snap = self.engine.snapshot()
        stats = snap.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("metrale_engine_alive", "1 while the engine loop runs", float(snap.alive))
        yield counter(
            "metrale_engine_restarts",
            "engine restarts after a failure (--restart-engine-on-failure)",
            getattr(self.engine, "restarts", 0),
        )
        info = getattr(self.engine, "info", None)
        if info is not None:
            model = GaugeMetricFamily(
                "metrale_model_info",
                "the served model (always 1): its name, dtype and device",
                labels=["model", "dtype", "device"],
            )
            model.add_metric([self.metrics.model_name, info.dtype, info.device], 1.0)
            yield model
        yield gauge(
            "metrale_num_requests_waiting", "sequences waiting for admission", snap.num_waiting
        )
        yield gauge(
            "metrale_num_requests_running", "sequences running (holding KV)", snap.num_running
        )
        yield gauge(
            "metrale_num_requests_swapped", "sequences swapped out to host memory", snap.num_swapped
        )
        yield gauge("metrale_kv_blocks_free", "free KV cache blocks", snap.num_free_blocks)
        yield gauge(
            "metrale_kv_blocks_cached",
            "KV blocks held only by the prefix cache (reclaimable)",
            snap.num_cache_only_blocks,
        )
        yield gauge("metrale_kv_blocks_total", "usable KV cache blocks", snap.num_total_blocks)
        used = 1.0 - snap.num_free_blocks / snap.num_total_blocks if snap.num_total_blocks else 0.0
        yield gauge("metrale_kv_cache_usage_ratio", "fraction of KV blocks in use", used)
        prompt, cached = self.metrics.prompt_token_counts()
        yield gauge(
            "metrale_prefix_cache_hit_rate",
            "prompt tokens served from the prefix cache / prompt tokens, since start",
            cached / prompt if prompt else 0.0,
        )
        yield counter("metrale_engine_steps", "engine steps run", snap.num_steps)
        yield counter(
            "metrale_engine_fed_steps",
            "decode steps launched before the previous step was read back (device token feed)",
            snap.fed_steps,
        )
        yield counter(
            "metrale_engine_drained_steps",
            "steps that waited for the previous step's tokens before planning (async "
            "scheduling fell back to a synchronous plan: admission, prefill, preemption)",
            snap.drained_steps,
        )
        yield counter(
            "metrale_engine_late_sampled_steps",
            "fed decode steps of grammar rows whose sampler waited for the previous step's "
            "tokens (the mask needs them on the host; the forward did not wait)",
            snap.late_sampled_steps,
        )
        yield by_label(
            "metrale_preemptions", "sequences preempted, by mode", "mode",
            {"recompute": stats.preemptions_recompute, "swap": stats.preemptions_swap},
        )  # fmt: skip
        yield counter("metrale_prefix_cache_queries", "prefix cache lookups", stats.prefix_queries)
        yield counter(
            "metrale_prefix_cache_hits",
            "prefix cache lookups that reused blocks",
            stats.prefix_hit_requests,
        )
        yield counter(
            "metrale_prefix_cache_hit_tokens",
            "prompt tokens reused from the prefix cache",
            stats.prefix_hit_tokens,
        )
        yield counter(
            "metrale_request_timeouts", "sequences ended by their deadline", stats.timeouts
        )
        yield counter("metrale_request_aborts", "sequences aborted (client gone, shutdown)", stats.aborts)  # fmt: skip
        cache = snap.prefix_cache
        yield counter(
            "metrale_prefix_cache_evicted_blocks",
            "KV blocks evicted from the prefix cache",
            cache.get("evicted_blocks", 0),
        )
        yield counter(
            "metrale_prefix_cache_bypassed_lookups",
            "prefix lookups refused because the model keeps recurrent state a KV hit cannot restore",
            cache.get("bypassed_lookups", 0),
        )
        yield from offload_metrics(cache)
        yield by_label(
            "metrale_swapped_blocks", "KV blocks moved to and from host memory", "direction",
            {"out": stats.swapped_out_blocks, "in": stats.swapped_in_blocks},
        )  # fmt: skip
        yield counter(
            "metrale_swap_spills",
            "swap records written to --swap-spill-dir because the host swap space was full",
            stats.swap_spills,
        )
        yield counter(
            "metrale_swap_fallbacks",
            "swap preemptions turned into recompute because swap space was full",
            stats.swap_fallbacks,
        )
        sampler = snap.sampler
        yield by_label(
            "metrale_sampler_batches",
            "sampler calls by path: greedy_kernel (one-pass greedy), candidates (draw on the "
            "top-k candidates), kernel (sort-free full-row kernel), torch (full-row torch path)",
            "path",
            {p: sampler.get(p, 0) for p in ("greedy_kernel", "candidates", "kernel", "torch")},
        )
        yield by_label(
            "metrale_sampler_full_row_batches",
            "sampled batches the candidate draw could not take, by reason",
            "reason",
            {
                k.removeprefix("full_row:"): v
                for k, v in sampler.items()
                if k.startswith("full_row:")
            },
        )
        yield counter(
            "metrale_sampler_rerouted_rows",
            "rows of candidate draws drawn on the full row instead (a NaN logit, or more ties "
            "at the k-th largest logit than the candidates hold)",
            sampler.get("candidate_rerouted_rows", 0),
        )
        yield by_label(
            "metrale_forwards", "model forwards, by path (graph replay or eager)", "path",
            {"graph": snap.graph_forwards, "eager": snap.eager_forwards},
        )  # fmt: skip
        if snap.cpu_projections:
            yield by_label(
                "metrale_cpu_projections",
                "CPU projection calls by path: gemv (few-row C kernel), onednn, torch "
                "(F.linear: small weights, other dtypes); gemv_unavailable counts few-row "
                "calls another path ran because the C kernel could not be built",
                "path", snap.cpu_projections,
            )  # fmt: skip
        if snap.cpu_fused_decode_forwards is not None:
            yield counter(
                "metrale_cpu_fused_decode_forwards",
                "CPU decode forwards run by the fused step (every layer in one C call; a "
                'subset of metrale_forwards{path="eager"}; METRALE_CPU_DECODE)',
                snap.cpu_fused_decode_forwards,
            )
        if snap.cpu_forwards_all_cores is not None:
            yield counter(
                "metrale_cpu_forwards_all_cores",
                "CPU forwards run on every core, the HTTP process's reserved one included "
                "(steps of >= 2e7 multiply-adds while nothing else keeps it busy)",
                snap.cpu_forwards_all_cores,
            )
        yield from snapshot_metrics(snap.prefix_cache)
        yield from spec_metrics(snap)
        yield from lora_metrics(snap)
        replica_stats = getattr(self.engine, "replica_stats", None)
        if replica_stats is not None:
            yield from replica_metrics(replica_stats())


class ServerMetrics:
    def __init__(self, engine: EngineHandle, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.requests = Counter(
            "metrale_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
            registry=r,
        )  # fmt: skip
        self.requests_active = Gauge(
            "metrale_requests_active", "HTTP requests in flight", registry=r
        )
        self.prompt_tokens = Counter(
            "metrale_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "metrale_prompt_tokens_cached",
            "prompt tokens of finished requests served from the prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            "metrale_generation_tokens", "generated tokens of finished requests", registry=r
        )
        self.finished = Counter(
            "metrale_request_finished", "finished choices by finish reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "metrale_time_to_first_token_seconds", "time from request arrival to its first token",
            buckets=_TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "metrale_inter_token_latency_seconds", "time between consecutive output tokens",
            buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "metrale_request_latency_seconds", "time from request arrival to its last token",
            buckets=_E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.client_aborts = Counter(
            "metrale_client_aborts",
            "requests whose client left before the answer was complete, by stage (body: "
            "while sending the body; queue: before the first token; stream: after it)",
            ["stage"], registry=r,
        )  # fmt: skip
        for stage in ABORT_STAGES:
            self.client_aborts.labels(stage)
        self.ignored_fields = Counter(
            "metrale_ignored_request_fields",
            "request-body fields no one defines, ignored (vLLM's policy; refused instead "
            "under --strict-request-fields), by endpoint",
            ["endpoint"], registry=r,
        )  # fmt: skip
        self._lock = threading.Lock()
        self._prompt_total = 0
        self._cached_total = 0
        r.register(_EngineCollector(engine, self))

    def prompt_token_counts(self) -> tuple[int, int]:
        with self._lock:
            return self._prompt_total, self._cached_total

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def record_finished(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, reasons: list[str]
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_prompt_tokens.inc(cached_tokens)
        self.generation_tokens.inc(completion_tokens)
        for reason in reasons:
            self.finished.labels(reason).inc()
        with self._lock:
            self._prompt_total += prompt_tokens
            self._cached_total += cached_tokens


class RequestTracker:
    """Latencies of one HTTP request: TTFT, inter-token gaps, end to end."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self._last_time = self.arrival
        self._tokens = 0
        self._done = False
        self._left = False

    def client_left(self, stage: str | None = None) -> None:
        """The client went away before its answer was complete: one client abort, at `stage`
        (default: "queue" before the first token, else "stream"); INFO, never an error."""
        if self._left:
            return
        self._left = True
        if stage is None:
            stage = "queue" if self.first_token is None else "stream"
        self.metrics.client_aborts.labels(stage).inc()
        logger.info("client disconnected (%s) after %.3f s", stage, time.monotonic() - self.arrival)

    def on_tokens(self, total_tokens: int) -> None:
        """Called with the running total of generated tokens (all choices) after an output."""
        new = total_tokens - self._tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
            self.metrics.ttft.observe(now - self.arrival)
            new -= 1
        if new > 0:
            gap = (now - self._last_time) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self._last_time = now
        self._tokens = total_tokens

    def finish(
        self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, reasons: list[str]
    ) -> None:
        if self._done:
            return
        self._done = True
        self.on_tokens(completion_tokens)
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.record_finished(prompt_tokens, cached_tokens, completion_tokens, reasons)
