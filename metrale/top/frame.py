"""What the dashboard shows, computed from a window of scrapes: gauges from the newest,
rates from the last two, latency percentiles from the histogram buckets' deltas over the
window (the last minute).

Owner: top.

Invariants:
- Rates are `None` until two scrapes exist, percentiles while nothing was observed: "no
  data" is never shown as 0. When the window saw no observation (a quiet server, `--once`),
  the percentiles cover everything since the server started, and say so (`latency_scope`).
- Percentiles are Prometheus' `histogram_quantile`: linear inside the bucket that holds the
  rank; a rank in the `+Inf` bucket reads as the last finite bound.
- Generation tok/s counts tokens as they stream: each token is one observation of either the
  TTFT (a request's first) or the inter-token histogram. Prompt tok/s counts prompts when
  their request finishes (`metrale_prompt_tokens_total`), so it lags long requests.
- The speculation panel exists when the server speculates (a per-position series, or drafts
  counted); the LoRA panel when any `metrale_lora_*` series exists.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from metrale.top.scrape import Scrape

#: Seconds of history the percentiles cover.
WINDOW_S = 60.0

TTFT = "metrale_time_to_first_token_seconds"
ITL = "metrale_inter_token_latency_seconds"


def histogram_buckets(scrape: Scrape, base: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of `base`'s buckets, ascending (`+Inf` last)."""
    buckets = [
        (math.inf if labels["le"] in ("+Inf", "inf") else float(labels["le"]), value)
        for labels, value in scrape.series(base + "_bucket")
        if "le" in labels
    ]
    return sorted(buckets)


def bucket_deltas(
    new: list[tuple[float, float]], old: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, max(0.0, count - before.get(le, 0.0))) for le, count in new]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """`histogram_quantile(q)` over cumulative `buckets`; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower  # pragma: no cover - the last bucket holds every observation


@dataclass
class Frame:
    """One refresh of the dashboard."""

    url: str
    model: str = "?"
    dtype: str = "?"
    device: str = "?"
    max_model_len: int | None = None
    engine_alive: bool = False
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    http_active: int = 0
    #: Seconds between the two scrapes the rates come from, and the percentiles' window.
    rate_interval_s: float | None = None
    window_s: float | None = None
    #: What the percentiles cover: "last Ns" (the window) or "since start" (nothing observed
    #: in the window: a quiet server, or `--once`).
    latency_scope: str = "since start"
    prompt_tok_s: float | None = None
    generation_tok_s: float | None = None
    generation_tokens: int = 0
    prompt_tokens: int = 0
    requests_total: int = 0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    kv_total: int = 0
    kv_free: int = 0
    kv_cached: int = 0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    timeouts: int = 0
    aborts: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    #: HTTP status -> requests answered with it (4xx and 5xx only).
    errors: dict[str, int] = field(default_factory=dict)
    #: None when the server does not speculate.
    spec: SpecPanel | None = None
    #: `metrale_lora_*` samples (name with labels -> value); None when there are none.
    lora: dict[str, float] | None = None

    @property
    def kv_used(self) -> int:
        """Blocks held by requests (not free, not only in the prefix cache)."""
        return max(0, self.kv_total - self.kv_free - self.kv_cached)


@dataclass
class SpecPanel:
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    #: Accepted / drafted tokens, since start and over the last interval.
    acceptance: float | None
    acceptance_recent: float | None
    #: Per draft position: rows whose draft there was accepted / rows with drafts.
    per_position: list[float]
    gate_switches: dict[str, int]


class Window:
    """The scrapes of the last `WINDOW_S` seconds (always the newest two, whatever their age)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.scrapes: deque[Scrape] = deque()

    def add(self, scrape: Scrape) -> None:
        self.scrapes.append(scrape)
        while len(self.scrapes) > 2 and scrape.time - self.scrapes[1].time >= self.window_s:
            self.scrapes.popleft()

    def frame(self, url: str) -> Frame:
        return build_frame(url, list(self.scrapes))


def _int(scrape: Scrape, name: str, **labels: str) -> int:
    return int(scrape.value(name, **labels) or 0)


def _sum(scrape: Scrape, name: str) -> float:
    return sum(value for _, value in scrape.series(name))


def _tokens_streamed(scrape: Scrape) -> float:
    return (scrape.value(TTFT + "_count") or 0.0) + (scrape.value(ITL + "_count") or 0.0)


def build_frame(url: str, scrapes: list[Scrape]) -> Frame:
    """The frame of `scrapes` (oldest first, at least one)."""
    new = scrapes[-1]
    frame = Frame(url=url)
    if new.models:
        card = new.models[0]
        frame.model = str(card.get("id", "?"))
        frame.max_model_len = card.get("max_model_len")
    for labels, _ in new.series("metrale_model_info"):
        frame.model = labels.get("model", frame.model)
        frame.dtype = labels.get("dtype", "?")
        frame.device = labels.get("device", "?")
    frame.engine_alive = bool(new.value("metrale_engine_alive"))
    frame.running = _int(new, "metrale_num_requests_running")
    frame.waiting = _int(new, "metrale_num_requests_waiting")
    frame.swapped = _int(new, "metrale_num_requests_swapped")
    frame.http_active = _int(new, "metrale_requests_active")
    frame.generation_tokens = int(_tokens_streamed(new))
    frame.prompt_tokens = _int(new, "metrale_prompt_tokens_total")
    frame.kv_total = _int(new, "metrale_kv_blocks_total")
    frame.kv_free = _int(new, "metrale_kv_blocks_free")
    frame.kv_cached = _int(new, "metrale_kv_blocks_cached")
    frame.kv_usage = new.value("metrale_kv_cache_usage_ratio") or 0.0
    frame.prefix_hit_rate = new.value("metrale_prefix_cache_hit_rate") or 0.0
    frame.preemptions = int(_sum(new, "metrale_preemptions_total"))
    frame.timeouts = _int(new, "metrale_request_timeouts_total")
    frame.aborts = _int(new, "metrale_request_aborts_total")
    for labels, value in new.series("metrale_request_finished_total"):
        frame.finished[labels.get("reason", "?")] = int(value)
    for labels, value in new.series("metrale_requests_total"):
        frame.requests_total += int(value)
        status = labels.get("status", "?")
        if not status.isdigit() or int(status) >= 400:
            frame.errors[status] = frame.errors.get(status, 0) + int(value)
    if len(scrapes) >= 2:
        prev, old = scrapes[-2], scrapes[0]
        dt = new.time - prev.time
        if dt > 0:
            frame.rate_interval_s = dt
            frame.generation_tok_s = (_tokens_streamed(new) - _tokens_streamed(prev)) / dt
            prompt_prev = prev.value("metrale_prompt_tokens_total") or 0.0
            frame.prompt_tok_s = (frame.prompt_tokens - prompt_prev) / dt
        frame.window_s = new.time - old.time
        frame.latency_scope = f"last {frame.window_s:.0f}s"
    _latencies(frame, new, scrapes[0] if len(scrapes) >= 2 else None)
    frame.spec = _spec_panel(scrapes)
    lora = {
        _sample_label(name, labels): value
        for (name, labels), value in new.samples.items()
        if name.startswith("metrale_lora_")
    }
    frame.lora = lora or None
    return frame


def _latencies(frame: Frame, new: Scrape, old: Scrape | None) -> None:
    """TTFT and ITL p50/p99 over the window; when nothing was observed in it (a quiet
    server, or `--once`'s short window), over everything since the server started."""
    pairs = ((TTFT, "ttft_p50", "ttft_p99"), (ITL, "itl_p50", "itl_p99"))
    windowed = {
        base: bucket_deltas(histogram_buckets(new, base), histogram_buckets(old, base))
        for base, _, _ in pairs
    } if old is not None else {}  # fmt: skip
    if not any(b and b[-1][1] > 0 for b in windowed.values()):
        windowed = {base: histogram_buckets(new, base) for base, _, _ in pairs}
        frame.latency_scope = "since start"
    for base, p50, p99 in pairs:
        setattr(frame, p50, quantile(0.5, windowed[base]))
        setattr(frame, p99, quantile(0.99, windowed[base]))


def _sample_label(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    short = name.removeprefix("metrale_lora_")
    return short + ("{" + ",".join(f"{k}={v}" for k, v in labels) + "}" if labels else "")


def _spec_panel(scrapes: list[Scrape]) -> SpecPanel | None:
    new = scrapes[-1]
    per_pos = sorted(
        (int(labels.get("position", 0)), value)
        for labels, value in new.series("metrale_spec_decode_num_accepted_tokens_per_pos_total")
    )
    drafts = _int(new, "metrale_spec_decode_num_drafts_total")
    if not per_pos and not drafts:
        return None
    draft_tokens = _int(new, "metrale_spec_decode_num_draft_tokens_total")
    accepted = _int(new, "metrale_spec_decode_num_accepted_tokens_total")
    recent = None
    if len(scrapes) >= 2:
        prev = scrapes[-2]
        d_draft = draft_tokens - _int(prev, "metrale_spec_decode_num_draft_tokens_total")
        d_acc = accepted - _int(prev, "metrale_spec_decode_num_accepted_tokens_total")
        recent = d_acc / d_draft if d_draft > 0 else None
    switches = {
        f"{labels.get('scope', '?')}->{labels.get('to', '?')}": int(value)
        for labels, value in new.series("metrale_spec_decode_gate_switches_total")
    }
    return SpecPanel(
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        verify_steps=_int(new, "metrale_spec_decode_verify_steps_total"),
        acceptance=accepted / draft_tokens if draft_tokens else None,
        acceptance_recent=recent,
        per_position=[value / drafts if drafts else 0.0 for _, value in per_pos],
        gate_switches=switches,
    )
