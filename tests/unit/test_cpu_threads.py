"""The engine's CPU thread policy (`metrale.engine.cpu_threads`): `--cpu-threads` wins, then
`OMP_NUM_THREADS`, else the process's cores less the ones reserved for the HTTP process (at
least one); a CUDA engine keeps torch's setting unless told; the server's process takes one
thread; `--cpu-threads` is a flag and a bad count is refused."""

from __future__ import annotations

import pytest
import torch

from metrale.config import EngineConfig
from metrale.engine import cpu_threads
from metrale.engine_flags import add_engine_arguments, engine_config_from_args
from metrale.errors import MetraleError


def test_policy_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = EngineConfig(device="cpu")
    assert cpu_threads.engine_threads(cpu, reserve=1)[0] == 3
    assert cpu_threads.engine_threads(cpu, reserve=0)[0] == 4
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 1)
    assert cpu_threads.engine_threads(cpu, reserve=1)[0] == 1
    assert cpu_threads.engine_threads(EngineConfig(device="cpu", cpu_threads=5), 1) == (
        5,
        "--cpu-threads",
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    threads, why = cpu_threads.engine_threads(cpu, reserve=1)
    assert threads == torch.get_num_threads() and "OMP_NUM_THREADS" in why
    assert cpu_threads.engine_threads(EngineConfig(device="cuda"), 1)[0] is None


def test_apply_sets_torch_threads_and_the_frontend_takes_one() -> None:
    before = torch.get_num_threads()
    try:
        # An explicit count stands: no governor.
        assert (
            cpu_threads.apply_engine_threads(EngineConfig(device="cpu", cpu_threads=2), 1) is None
        )
        assert torch.get_num_threads() == 2
        cpu_threads.apply_frontend_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_flag_and_validation() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--cpu-threads", "3"])
    assert engine_config_from_args(args).cpu_threads == 3
    with pytest.raises(MetraleError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)


def test_a_served_automatic_count_gets_a_governor(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        governor = cpu_threads.apply_engine_threads(EngineConfig(device="cpu"), reserve=1)
        assert governor is not None and (governor.base, governor.top) == (1, 2)
        assert torch.get_num_threads() == 1
        assert cpu_threads.apply_engine_threads(EngineConfig(device="cpu"), reserve=0) is None
    finally:
        torch.set_num_threads(before)


def test_a_governed_engine_process_starts_with_a_short_openmp_spin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`engine_process_env`: `GOMP_SPINCOUNT` only for an engine process that will run a
    governor, and never over the user's own OpenMP wait settings."""
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    for name in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    cpu = EngineConfig(device="cpu")
    spin = {"GOMP_SPINCOUNT": str(cpu_threads.GOVERNED_SPIN_COUNT)}
    assert cpu_threads.engine_process_env(cpu, reserve=1) == spin
    assert cpu_threads.engine_process_env(cpu, reserve=0) == {}
    assert cpu_threads.engine_process_env(EngineConfig(device="cpu", cpu_threads=1), 1) == {}
    assert cpu_threads.engine_process_env(EngineConfig(device="cuda"), 1) == {}
    assert cpu_threads.engine_process_env(cpu, 1, {"OMP_NUM_THREADS": "1"}) == {}  # a replica
    assert cpu_threads.engine_process_env(cpu, 1, {"CUDA_VISIBLE_DEVICES": ""}) == spin
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert cpu_threads.engine_process_env(cpu, reserve=1) == {}
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 1)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert cpu_threads.engine_process_env(cpu, reserve=1) == {}


def test_governor_takes_every_core_for_large_steps_only_while_the_others_are_idle() -> None:
    """`CpuThreadGovernor`: nothing changes before a window has passed; then a step of
    `MIN_WORK` multiply-adds or more runs on `top` threads while the other processes keep less
    than `SPARE_BELOW` cores busy, a smaller step on `base`; a busy neighbour (a core's worth
    of CPU time that is not the engine's) sends every step back to `base`; an unreadable
    /proc/stat keeps `base`."""
    before = torch.get_num_threads()
    now, busy, own = [0.0], [0.0], [0.0]
    governor = cpu_threads.CpuThreadGovernor(
        1, 2, busy_seconds=lambda: busy[0], own_seconds=lambda: own[0], clock=lambda: now[0]
    )
    governor.work_per_token = int(governor.MIN_WORK) // 8
    big = 8
    try:
        torch.set_num_threads(1)
        assert governor.before_forward(big) == 1  # no window yet
        now[0], busy[0], own[0] = 0.25, 0.3, 0.28  # the engine's own time: others ~0.08
        assert governor.before_forward(big) == 2 and torch.get_num_threads() == 2
        assert governor.before_forward(big - 1) == 1 and torch.get_num_threads() == 1
        assert governor.forwards_at_top == 1
        now[0], busy[0], own[0] = 0.5, 0.8, 0.3  # 0.5 s busy, 0.02 s of it the engine's
        assert governor.before_forward(big) == 1 and governor.others_busy > 1.5
        now[0], busy[0], own[0] = 0.75, 0.85, 0.35
        assert governor.before_forward(big) == 2
        unreadable = cpu_threads.CpuThreadGovernor(
            1, 2, busy_seconds=lambda: None, own_seconds=lambda: own[0], clock=lambda: now[0]
        )
        unreadable.work_per_token = governor.work_per_token
        now[0] = 1.0
        assert unreadable.before_forward(big) == 1
    finally:
        torch.set_num_threads(before)
