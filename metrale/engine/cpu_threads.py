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
- Served (a reserve left to the HTTP process) with the count chosen here, the engine also
  gets a `CpuThreadGovernor`: a forward of at least `MIN_WORK` multiply-adds runs on every core
  while the other processes leave the reserved core idle (measured per window from
  `/proc/stat`), else on the reserved count; counted in `forwards_at_top`.
- Nothing changes for an engine on CUDA (its host threads are not the bottleneck), except
  that an explicit `cpu_threads` is still applied.
- An engine process that will run a governor starts with `GOMP_SPINCOUNT` =
  `GOVERNED_SPIN_COUNT` (`engine_process_env`; libgomp reads it once, when torch loads),
  unless its environment already sets `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY`: an OpenMP
  worker spins that long after a parallel region before it sleeps, and the default (300,000
  pauses, ~11 ms on the 2-core EPYC VM of issue 26) left the reserved core spinning after
  every forward the governor gave it. At one stream of the tiny model each prompt's prefill
  (2.75e7 multiply-adds, above `MIN_WORK`) was such a forward among base-count decode steps:
  the worker's spin was 0.17 ms of the engine process's 0.72 ms of CPU per output token, on
  the core the HTTP process needs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

import torch

from metrale.config import EngineConfig

logger = logging.getLogger(__name__)


#: Pauses an OpenMP worker of a governed engine spins after a parallel region before it
#: sleeps (`GOMP_SPINCOUNT`; libgomp's default is 300,000): ~1 ms on the machine of issue 26,
#: which still bridges a forward's regions and the host work between two forwards at `top`
#: threads (then the worker is not woken through the kernel), and leaves the core to the
#: others soon after the last one (the module docstring).
GOVERNED_SPIN_COUNT = 30_000
#: The variables that set how OpenMP workers wait; one set by the user is left alone.
_WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    return max(1, len(_affinity()))


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


def engine_process_env(
    config: EngineConfig, reserve: int, child_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What the environment of an engine process built from `config` (leaving `reserve`
    cores, with `child_env` set over this process's environment) gets from here:
    `GOMP_SPINCOUNT` where it will run a `CpuThreadGovernor` (a CPU engine whose count
    `apply_engine_threads` chooses, below the cores) and nothing sets how OpenMP waits."""
    env = {**os.environ, **(child_env or {})}
    if any(env.get(name) for name in _WAIT_VARIABLES) or not reserve:
        return {}
    if config.cpu_threads is not None or env.get("OMP_NUM_THREADS") or not _on_cpu(config):
        return {}
    if available_cores() <= reserve:
        return {}
    return {"GOMP_SPINCOUNT": str(GOVERNED_SPIN_COUNT)}


def apply_engine_threads(config: EngineConfig, reserve: int) -> CpuThreadGovernor | None:
    """Set this process's torch threads for an engine (see the module docstring). Returns
    the governor that raises them to every core for large steps while the reserved cores
    are idle, when the count was chosen here with a reserve (else None: the count stands)."""
    threads, why = engine_threads(config, reserve)
    if threads is None:
        return None
    torch.set_num_threads(threads)
    logger.info("engine CPU threads: %d (%s)", threads, why)
    cores = available_cores()
    automatic = config.cpu_threads is None and not os.environ.get("OMP_NUM_THREADS")
    if not automatic or threads >= cores:
        return None
    logger.info(
        "engine CPU threads: steps of >= %.0e multiply-adds take all %d cores while the "
        "other processes leave them idle (< %.2f cores busy beside the engine)",
        CpuThreadGovernor.MIN_WORK, cores, CpuThreadGovernor.SPARE_BELOW,
    )  # fmt: skip
    return CpuThreadGovernor(threads, cores)


class CpuThreadGovernor:
    """The engine's torch threads per forward: `base` (the cores less the HTTP process's
    reserve) for small steps, `top` (every core) for a step of at least `MIN_WORK`
    multiply-adds (tokens x the model's parameters) while the rest of the machine is nearly
    idle: the CPU time of the engine's cores (from `/proc/stat`) less the engine process's
    own, over windows of `WINDOW_S`, below `SPARE_BELOW` cores. A busy neighbour (another
    process spinning on a core) keeps the engine at `base`, where an OpenMP region does not
    wait for a thread the neighbour preempts; an idle machine gives prefill chunks and
    decode steps of a model of tens of millions of parameters the reserved core (issue 26:
    C=16 on 2 cores 675 -> 947 tok/s with two threads, but a busy core took it to 225 tok/s
    and TTFT p90 to 6.8x p50).

    `MIN_WORK` 2e7: the small model's (25.7M parameters) one-row decode step takes the second
    core, a tiny model's (0.43M) decode steps never do below 46 rows. Served small model,
    three interleaved pairs of runs against 2e8 (which kept its C=1 and C=4 steps on one
    thread): TPOT p50 at C=1 4.89 / 3.36 / 3.68 -> 3.57 / 3.56 / 3.19 ms, at C=4 7.87 / 6.48 /
    6.52 -> 6.97 / 5.45 / 5.93 ms; C=16 (above both) 810 / 1111 / 1032 -> 842 / 1147 / 912
    tok/s, the machine's noise. In process a tiny model's 4-row step on two threads gained
    10% and served it lost (the HTTP process keeps that core busy at thousands of tokens a
    second, faster than a window notices), so tiny steps stay below the bound."""

    MIN_WORK = 2e7
    WINDOW_S = 0.2
    SPARE_BELOW = 0.6

    def __init__(
        self,
        base: int,
        top: int,
        busy_seconds: Callable[[], float | None] | None = None,
        own_seconds: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base, self.top = base, top
        self._busy = busy_seconds or _cores_busy_seconds(_affinity())
        self._own, self._clock = own_seconds, clock
        self._start = (clock(), self._busy(), own_seconds())
        self._current = torch.get_num_threads()
        self._spare = False
        #: Multiply-adds a token costs: the model's parameters (`Engine` sets it; 0 until
        #: then, so no step counts as large).
        self.work_per_token = 0
        #: Cores the other processes kept busy over the last window (metrics, logs).
        self.others_busy = 0.0
        #: Forwards run at `top` threads (the `metrale_cpu_forwards_all_cores` counter).
        self.forwards_at_top = 0

    def set_model(self, model: object) -> None:
        """`work_per_token` from the model's torch module (its `module`), if it has one."""
        module = getattr(model, "module", None)
        if isinstance(module, torch.nn.Module):
            self.work_per_token = sum(p.numel() for p in module.parameters())

    def before_forward(self, tokens: int) -> int:
        """Set the threads for a forward of `tokens` tokens; returns them."""
        now = self._clock()
        start_time, start_busy, start_own = self._start
        if now - start_time >= self.WINDOW_S:
            busy, own = self._busy(), self._own()
            if busy is None or start_busy is None:  # /proc/stat unreadable: stay at `base`
                spare, others = False, float("nan")
            else:
                others = max(0.0, (busy - start_busy) - (own - start_own)) / (now - start_time)
                spare = others < self.SPARE_BELOW
            self.others_busy = others
            if spare != self._spare:
                logger.debug("engine CPU threads: %.2f cores busy beside the engine", others)
            self._spare = spare
            self._start = (now, busy, own)
        large = tokens * self.work_per_token >= self.MIN_WORK
        want = self.top if self._spare and large else self.base
        if want != self._current:
            torch.set_num_threads(want)
            self._current = want
        self.forwards_at_top += want == self.top
        return want


def _affinity() -> list[int]:
    """The ids of the cores this process may run on (all of them off Linux)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def _cores_busy_seconds(cpus: list[int]) -> Callable[[], float | None]:
    """A reader of the seconds `cpus` have spent busy (not idle, not waiting on I/O) since
    boot, from `/proc/stat`'s per-CPU lines; None where it is unreadable (the governor then
    keeps `base`)."""
    names = {f"cpu{c}".encode() for c in cpus}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read() -> float | None:
        total = 0
        try:
            with open("/proc/stat", "rb") as stat:
                for line in stat:
                    fields = line.split()
                    if fields and fields[0] in names:
                        values = [int(v) for v in fields[1:9]]
                        total += sum(values) - values[3] - values[4]  # less idle and iowait
        except OSError:
            return None
        return total / tick

    return read


def apply_frontend_threads() -> None:
    """The server's process when the engine runs in a child: one torch thread (it runs no
    model; more would only compete with the engine for cores)."""
    if torch.get_num_threads() != 1:
        logger.info("server process: 1 torch thread (the engine process runs the model)")
        torch.set_num_threads(1)
