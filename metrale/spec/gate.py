"""The throughput gate: speculate only where it pays, measured per batch width and per row.

Owner: spec. The engine feeds it every step's wall time (launch to tokens read back), the
number of sequences and query rows in it, and each verify row's verdict; it answers, before
each plan, whether speculation is on for the step's batch width and for each row.

The cost of a step is fitted per batch-width bucket (powers of two) as
`seconds = base + per_row * query_rows`, by exponentially weighted least squares over plain
and verify steps alike, so `per_row` (the price of one draft row) is measured, not guessed.
A row's drafts pay when the tokens they are expected to add, worth `base / width + per_row`
seconds each (the cost of a plain decode row-step), exceed what the drafts cost, `per_row *
drafts`. The expected gain of `k` drafts at acceptance rate `a` is `a + a**2 + ... + a**k`.

Invariants:
- Global, per bucket: after `window` verify steps and `window` plain steps, the bucket turns
  speculation off when the delivered tokens per second of verify steps falls below that of
  plain steps by `margin`; it probes speculation again (one window) after `probe_tokens`
  tokens per row of plain decoding, and while on re-measures plain decoding (one window) every
  `REFRESH * probe_tokens` tokens per row. Each switch is counted (`global_off`, `global_on`).
- Per row: after `min_verifies` verdicts, a row whose expected gain does not cover its draft
  cost stops speculating; it is probed again after `probe_tokens` more generated tokens,
  doubling the wait each time it fails again (at most 64x). Counted (`row_off`, `row_on`).
- `enabled=False` (`gate: "off"`) answers yes everywhere and records nothing but counters.
- Pure Python, no clock of its own: the engine passes durations in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Weight of a new observation in the running averages (the seed's gate uses 0.3).
EWMA = 0.3
#: Forgetting factor of the per-bucket cost fit (per step).
FIT_DECAY = 0.98
MAX_BACKOFF = 64
#: While speculation is on, plain decoding is re-measured every `REFRESH * probe_tokens`
#: tokens per row (the seed refreshes every 1024 and probes every 256).
REFRESH = 4


@dataclass
class _CostFit:
    """Weighted least squares of `seconds ~ base + per_row * rows` with forgetting."""

    sw: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, rows: float, seconds: float) -> None:
        d = FIT_DECAY
        self.sw = self.sw * d + 1.0
        self.sx = self.sx * d + rows
        self.sy = self.sy * d + seconds
        self.sxx = self.sxx * d + rows * rows
        self.sxy = self.sxy * d + rows * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(base, per_row), or None before two distinct row counts were seen."""
        if self.sw <= 0:
            return None
        var = self.sxx * self.sw - self.sx * self.sx
        if var <= 1e-9 * max(1.0, self.sxx * self.sw):
            return None
        per_row = (self.sxy * self.sw - self.sx * self.sy) / var
        base = (self.sy - per_row * self.sx) / self.sw
        return base, max(per_row, 0.0)


@dataclass
class _Bucket:
    fit: _CostFit = field(default_factory=_CostFit)
    #: Delivered tokens per second, EWMA, of verify steps and of plain steps.
    spec_rate: float | None = None
    plain_rate: float | None = None
    spec_steps: int = 0
    plain_steps: int = 0
    on: bool = True
    #: Tokens generated in this bucket since the last switch or probe.
    tokens_since: int = 0
    #: While on: a plain window is being measured (refresh); while off: a spec probe.
    probing: int = 0


@dataclass
class _Row:
    acceptance: float | None = None
    verifies: int = 0
    off_until: int | None = None  # generated-token count at which the row is probed again
    backoff: int = 1


class SpecGate:
    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        enabled: bool = True,
        window: int = 16,
        probe_tokens: int = 256,
        margin: float = 0.05,
        min_verifies: int = 4,
    ) -> None:
        self.k = num_speculative_tokens
        self.enabled = enabled
        self.window = window
        self.probe_tokens = probe_tokens
        self.margin = margin
        self.min_verifies = min_verifies
        self._buckets: dict[int, _Bucket] = {}
        self._rows: dict[str, _Row] = {}
        self.counters: dict[str, int] = {
            "global_off": 0,
            "global_on": 0,
            "row_off": 0,
            "row_on": 0,
        }

    # ------------------------------------------------------------------ answers

    @staticmethod
    def bucket_of(width: int) -> int:
        """Power-of-two bucket of a batch width (1, 2, 4, ...)."""
        b = 1
        while b < width:
            b <<= 1
        return b

    def step_allowed(self, width: int) -> bool:
        """Whether a step of `width` sequences may speculate (the global, per-bucket gate)."""
        if not self.enabled:
            return True
        bucket = self._bucket(width)
        if bucket.on:
            return bucket.probing == 0  # a plain refresh window runs without drafts
        return bucket.probing > 0

    def row_allowed(self, seq_id: str, num_generated: int) -> bool:
        """Whether this row may speculate; a row switched off is probed again when its
        generated-token count reaches the probe point."""
        if not self.enabled:
            return True
        row = self._rows.get(seq_id)
        if row is None or row.off_until is None:
            return True
        if num_generated >= row.off_until:
            row.off_until = None
            row.verifies = 0
            row.acceptance = None
            self.counters["row_on"] += 1
            return True
        return False

    # ---------------------------------------------------------------- feedback

    def record_step(
        self, width: int, query_rows: int, seconds: float, tokens: int, verify: bool
    ) -> None:
        """One finished step: `width` sequences (decode rows), `query_rows` rows computed
        for them (width plus drafts), its wall time and the tokens it delivered."""
        if width <= 0 or seconds <= 0:
            return
        bucket = self._bucket(width)
        bucket.fit.add(query_rows, seconds)
        if not self.enabled:
            return
        rate = tokens / seconds
        if verify:
            bucket.spec_rate = _ewma(bucket.spec_rate, rate)
            bucket.spec_steps += 1
        else:
            bucket.plain_rate = _ewma(bucket.plain_rate, rate)
            bucket.plain_steps += 1
        bucket.tokens_since += tokens
        if bucket.probing:
            bucket.probing -= 1
            if bucket.probing == 0:
                self._arbitrate(bucket)
            return
        if bucket.on and bucket.spec_steps >= self.window and bucket.plain_steps < self.window:
            bucket.probing = self.window  # measure plain decoding once, to compare
            bucket.tokens_since = 0
        elif bucket.tokens_since >= (1 if not bucket.on else REFRESH) * self.probe_tokens * width:
            bucket.probing = self.window  # probe speculation, or refresh the plain estimate
            bucket.tokens_since = 0

    def record_verify(self, seq_id: str, drafted: int, accepted: int, num_generated: int) -> None:
        """A row's verdict; may switch the row off (see the invariants)."""
        if drafted <= 0 or not self.enabled:
            return
        row = self._rows.setdefault(seq_id, _Row())
        row.acceptance = _ewma(row.acceptance, accepted / drafted)
        row.verifies += 1
        if row.verifies < self.min_verifies or row.off_until is not None:
            return
        if not self.row_pays(row.acceptance, drafted, self._any_fit()):
            row.off_until = num_generated + self.probe_tokens * row.backoff
            row.backoff = min(row.backoff * 2, MAX_BACKOFF)
            self.counters["row_off"] += 1
        else:
            row.backoff = 1

    def forget(self, seq_id: str) -> None:
        self._rows.pop(seq_id, None)

    # ----------------------------------------------------------------- helpers

    @staticmethod
    def expected_gain(acceptance: float, drafts: int) -> float:
        """Expected accepted drafts of `drafts` at i.i.d. acceptance `acceptance`."""
        return sum(acceptance**i for i in range(1, drafts + 1))

    def row_pays(
        self, acceptance: float, drafts: int, fit: tuple[float, float, int] | None
    ) -> bool:
        """Whether `drafts` drafts at `acceptance` are worth their measured cost; without a
        fit yet, whether at least one in eight drafts is accepted."""
        if fit is None:
            return acceptance >= 0.125
        base, per_row, width = fit
        row_step = base / max(width, 1) + per_row  # seconds of one plain decode row-step
        return self.expected_gain(acceptance, drafts) * row_step > per_row * drafts

    def _any_fit(self) -> tuple[float, float, int] | None:
        """The most-measured bucket's (base, per_row, width)."""
        best: tuple[float, float, int] | None = None
        weight = 0.0
        for width, bucket in self._buckets.items():
            coeffs = bucket.fit.coefficients()
            if coeffs is not None and bucket.fit.sw > weight:
                best, weight = (coeffs[0], coeffs[1], width), bucket.fit.sw
        return best

    def _bucket(self, width: int) -> _Bucket:
        key = self.bucket_of(width)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        return bucket

    def _arbitrate(self, bucket: _Bucket) -> None:
        spec, plain = bucket.spec_rate, bucket.plain_rate
        if spec is None or plain is None:
            return
        if bucket.on and spec < plain * (1.0 - self.margin):
            bucket.on = False
            self.counters["global_off"] += 1
        elif not bucket.on and spec > plain * (1.0 + self.margin):
            bucket.on = True
            self.counters["global_on"] += 1
        bucket.tokens_since = 0

    def cost_fit(self, width: int) -> tuple[float, float] | None:
        """The measured (base seconds, seconds per query row) of a bucket, if fitted."""
        bucket = self._buckets.get(self.bucket_of(width))
        return None if bucket is None else bucket.fit.coefficients()


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - EWMA) * old + EWMA * new
