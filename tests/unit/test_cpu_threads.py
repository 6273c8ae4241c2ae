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
        assert cpu_threads.apply_engine_threads(EngineConfig(device="cpu", cpu_threads=2), 1) == 2
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
