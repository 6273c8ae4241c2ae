"""The throughput gate against synthetic step costs: it keeps speculation where verify steps
deliver more tokens per second, turns it off (globally per batch bucket, or per row) where
they deliver fewer, probes back, and counts every switch."""

from __future__ import annotations

import random

from metrale.spec.gate import SpecGate


def drive(
    gate: SpecGate,
    width: int,
    steps: int,
    base: float,
    per_row: float,
    k: int,
    acceptance: float,
    rng: random.Random,
) -> tuple[int, int]:
    """Run `steps` steps of `width` rows under a linear cost model; returns (verify steps,
    plain steps) the gate chose."""
    verify = plain = 0
    for _ in range(steps):
        spec = gate.step_allowed(width)
        if spec:
            accepted = [sum(1 for _ in range(k) if rng.random() < acceptance) for _ in range(width)]
            rows = width * (1 + k)
            tokens = width + sum(accepted)
            verify += 1
        else:
            rows, tokens = width, width
            plain += 1
        seconds = (base + per_row * rows) * rng.uniform(0.97, 1.03)
        gate.record_step(width, rows, seconds, tokens, spec)
    return verify, plain


def test_cheap_verify_and_high_acceptance_keeps_speculating() -> None:
    gate = SpecGate(4, window=8, probe_tokens=64)
    rng = random.Random(0)
    verify, plain = drive(gate, 1, 400, base=4e-3, per_row=5e-5, k=4, acceptance=0.8, rng=rng)
    assert verify > 5 * plain
    assert gate.counters["global_off"] == 0
    fit = gate.cost_fit(1)
    assert fit is not None and abs(fit[1] - 5e-5) < 2e-5  # the per-row cost is measured


def test_expensive_verify_turns_off_then_probes_and_counts() -> None:
    gate = SpecGate(4, window=8, probe_tokens=64)
    rng = random.Random(1)
    # Compute-bound batch: a draft row costs as much as a decode row, little is accepted.
    verify, plain = drive(gate, 64, 600, base=1e-3, per_row=1e-4, k=4, acceptance=0.2, rng=rng)
    assert plain > 3 * verify
    assert gate.counters["global_off"] >= 1
    assert not gate.step_allowed(64) or gate._bucket(64).probing > 0
    # Probes keep happening (speculation is re-measured), and never flip it back on here.
    assert verify > 8 and gate.counters["global_on"] == 0
    # Another bucket is measured on its own.
    assert gate.step_allowed(1)


def test_global_gate_comes_back_when_speculation_starts_paying() -> None:
    gate = SpecGate(4, window=8, probe_tokens=32)
    rng = random.Random(2)
    drive(gate, 8, 300, base=1e-3, per_row=1e-4, k=4, acceptance=0.1, rng=rng)
    assert gate.counters["global_off"] >= 1
    drive(gate, 8, 600, base=1e-3, per_row=1e-6, k=4, acceptance=0.9, rng=rng)
    assert gate.counters["global_on"] >= 1 and gate._bucket(8).on


def test_row_gate_turns_off_a_row_that_loses_and_probes_it_later() -> None:
    gate = SpecGate(4, window=8, probe_tokens=100, min_verifies=4)
    rng = random.Random(3)
    drive(gate, 4, 100, base=4e-3, per_row=4e-4, k=4, acceptance=0.5, rng=rng)
    for i in range(6):
        gate.record_verify("bad", 4, 0, num_generated=10 + i)
        gate.record_verify("good", 4, 4, num_generated=10 + i)
    assert not gate.row_allowed("bad", 20)
    assert gate.row_allowed("good", 20)
    assert gate.counters["row_off"] == 1
    # Probed again after probe_tokens more tokens; failing again doubles the wait.
    assert gate.row_allowed("bad", 15 + 100)
    assert gate.counters["row_on"] == 1
    for i in range(4):
        gate.record_verify("bad", 4, 0, num_generated=120 + i)
    assert not gate.row_allowed("bad", 123 + 150)
    assert gate.row_allowed("bad", 123 + 200)
    gate.forget("bad")
    assert gate.row_allowed("bad", 0)


def test_row_pays_uses_the_measured_costs() -> None:
    gate = SpecGate(4)
    # A plain decode row-step costs 60 ms / 64 + 0.2 ms = 1.14 ms; a draft row 0.2 ms.
    assert gate.row_pays(0.5, 4, (0.06, 0.0002, 64))
    assert not gate.row_pays(0.05, 4, (0.06, 0.0002, 64))
    assert SpecGate.expected_gain(0.5, 3) == 0.5 + 0.25 + 0.125


def test_gate_off_answers_yes_and_never_switches() -> None:
    gate = SpecGate(4, enabled=False, window=4, probe_tokens=8)
    rng = random.Random(4)
    verify, plain = drive(gate, 64, 200, base=1e-3, per_row=1e-4, k=4, acceptance=0.0, rng=rng)
    assert plain == 0 and verify == 200
    for i in range(10):
        gate.record_verify("x", 4, 0, i)
    assert gate.row_allowed("x", 11)
    assert all(v == 0 for v in gate.counters.values())
