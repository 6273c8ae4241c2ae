"""How many torch threads an engine on the CPU runs, decided once per process.

Owner: engine. `apply_engine_threads` is called where an engine is built on the CPU (the
engine process's child, `AsyncEngine`, and `LLM` when `cpu_threads` is given: offline, the caller's torch setting
stands); `apply_frontend_threads` by the server's
process when the engine runs in a child (`EngineProcess`).

Why (issue 26): torch's default is one OpenMP thread per core, in every process. On a 2-core
machine the engine's two threads and the HTTP process's per-token work contend for the two
cores, and any other busy process makes it worse: an OpenMP region waits for its slowest
thread, so one preempted thread stalls every op of the forward (a tiny-model TPOT went from
~1 ms to 34 ms with other work on the machine, and back to ~6 ms with one thread). The
engine therefore leaves one core to the HTTP process when it serves, and the server's own
process (which runs no model) takes one thread.

Invariants:
- The engine's count is, in order: `EngineConfig.cpu_threads` when given; else the
  environment's `OMP_NUM_THREADS` when set (torch already read it); else the cores this
  process may run on (`os.sched_getaffinity`) less `reserve` (at least 1). The choice and
  where it came from are logged.
- Nothing changes for an engine on CUDA (its host threads are not the bottleneck), except
  that an explicit `cpu_threads` is still applied.
"""

from __future__ import annotations

import logging
import os

import torch

from metrale.config import EngineConfig

logger = logging.getLogger(__name__)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def _on_cpu(config: EngineConfig) -> bool:
    if config.device == "cpu":
        return True
    return config.device == "auto" and not torch.cuda.is_available()


def engine_threads(config: EngineConfig, reserve: int) -> tuple[int | None, str]:
    """`(threads, why)`: the intra-op threads an engine built from `config` should run, or
    None to leave torch's setting (CUDA without an explicit count)."""
    if config.cpu_threads is not None:
        return config.cpu_threads, "--cpu-threads"
    if not _on_cpu(config):
        return None, "CUDA engine"
    env = os.environ.get("OMP_NUM_THREADS")
    if env:
        return torch.get_num_threads(), f"OMP_NUM_THREADS={env}"
    cores = available_cores()
    if reserve:
        return max(1, cores - reserve), f"{cores} cores, {reserve} left to the HTTP process"
    return cores, f"{cores} cores"


def apply_engine_threads(config: EngineConfig, reserve: int) -> int:
    """Set this process's torch threads for an engine (see the module docstring); returns
    the count in force."""
    threads, why = engine_threads(config, reserve)
    if threads is not None:
        torch.set_num_threads(threads)
        logger.info("engine CPU threads: %d (%s)", threads, why)
    return torch.get_num_threads()


def apply_frontend_threads() -> None:
    """The server's process when the engine runs in a child: one torch thread (it runs no
    model; more would only compete with the engine for cores)."""
    if torch.get_num_threads() != 1:
        logger.info("server process: 1 torch thread (the engine process runs the model)")
        torch.set_num_threads(1)
