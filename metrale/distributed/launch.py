"""Starting a tensor-parallel engine: rank 0 (the engine's process) checks the config, spawns
one worker process per other rank on this host (or, under `torchrun`, finds them started by
it, on this host or others), and every rank loads its share through the ordinary factory
(`load_model(..., sharding=RankSharding)`), in lockstep.

Owner: distributed.

Invariants:
- Refused before any process starts, with an error naming the setting: architectures and
  shapes `ShardPlan` cannot cut, and the features not yet tensor-parallel (speculative
  decoding, LoRA, float8 KV, quantized weights, KV offload tiers, high-speed swap, swap
  preemption, batch-invariant kernels): never silently served by one rank.
- Rendezvous: a `TCPStore` (every key under `metrale/`) on 127.0.0.1 at a free port (port 0:
  the OS picks), or under `torchrun` at its `MASTER_ADDR:MASTER_PORT` (rank 0 hosts it unless
  torchrun's agent does); never our own sockets for tensors. Under `torchrun` the world
  size must equal `tensor_parallel_size`, and ranks above 0 run `torchrun_worker` (the CLI
  sends them there) instead of an engine. Every worker reports `ready`, then the checkpoint's fingerprint
  (config.json and the world's settings); a mismatch or a worker that exits first ends
  start-up with an error naming the rank (and its own error message, when it sent one).
- On any start-up failure every worker is killed; once loaded, rank 0's module is armed
  (it drives the workers) and `close` (or the process's exit: workers watch their parent)
  ends them.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from metrale.config import EngineConfig
from metrale.distributed.group import DEFAULT_TIMEOUT, TensorParallel, connect
from metrale.distributed.module import TensorParallelModule, serve_steps
from metrale.distributed.shard import ShardPlan, shard_module
from metrale.errors import EngineDeadError, InvalidRequestError, MetraleError
from metrale.model_config import ModelConfig
from metrale.model_engine.factory import LoadReport, load_model
from metrale.model_engine.load_setup import resolve_device
from metrale.model_engine.transformer_model import TransformerModel
from metrale.models.config import parse_model_config, read_config_json
from metrale.progress import LoadProgress

logger = logging.getLogger(__name__)

#: How long rank 0 waits for every worker to start (import torch, reach the store).
STARTUP_TIMEOUT_S = 300.0


class RankSharding:
    """One rank's part in loading (`factory.ModelSharding`)."""

    def __init__(self, tp: TensorParallel, expert_parallel: bool) -> None:
        self.tp = tp
        self.expert_parallel = expert_parallel
        self.plan: ShardPlan | None = None
        self.full: ModelConfig | None = None

    def local_config(self, mcfg: ModelConfig) -> ModelConfig:
        self.full = mcfg
        self.plan = ShardPlan.for_model(
            mcfg, self.tp.rank, self.tp.world_size, self.expert_parallel
        )
        return self.plan.local_config(mcfg)

    def prepare(self, module: nn.Module) -> None:
        assert self.plan is not None
        shard_module(module, self.plan, self.tp)

    def read(self, name: str, handle: Any) -> tuple[str, torch.Tensor] | None:
        assert self.plan is not None
        return self.plan.read(name, handle)

    def wrap(self, module: nn.Module) -> nn.Module:
        assert self.full is not None
        return TensorParallelModule(module, self.tp, self.full.vocab_size)

    def agree_blocks(self, blocks: int) -> int:
        value = torch.tensor([blocks], dtype=torch.int64)
        self.tp.control.allreduce([value], dist.ReduceOp.MIN).wait()
        agreed = int(value[0])
        if agreed != blocks:
            logger.info("tensor parallel: KV pool %d blocks (the smallest rank's)", agreed)
        return agreed


def check_config(config: EngineConfig, mcfg: ModelConfig) -> None:
    """Refuse, naming the setting, what tensor parallelism does not serve yet."""
    n = config.tensor_parallel_size
    ShardPlan.for_model(mcfg, 0, n, config.enable_expert_parallel)  # shapes and architecture
    refused = [
        ("speculative_config", config.speculative_config is not None, "speculative decoding"),
        ("enable_lora", config.lora_enabled, "LoRA adapters"),
        ("kv_cache_dtype", config.kv_cache_dtype != "auto", "float8 KV"),
        ("quantization", config.quantization is not None, "quantized weights"),
        ("quantization", bool(mcfg.raw.get("quantization_config")), "quantized checkpoints"),
        ("kv_offload_host_gb", config.kv_offload_host_gb > 0, "the host KV tier"),
        ("kv_offload_disk", config.kv_offload_disk is not None, "the disk KV tier"),
        ("high_speed_swap", config.high_speed_swap, "high-speed swap"),
        ("preemption_mode", config.preemption_mode != "recompute", "swap preemption"),
        ("batch_invariant", config.batch_invariant, "batch-invariant kernels"),
    ]
    for param, on, what in refused:
        if on:
            raise InvalidRequestError(
                f"tensor_parallel_size {n}: {what} ({param}) is not tensor-parallel yet; "
                "serve it with tensor_parallel_size 1",
                param=param,
            )
    device = resolve_device(config.device)
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise InvalidRequestError(
            f"tensor_parallel_size {n} needs {n} GPUs; this host has {torch.cuda.device_count()}",
            param="tensor_parallel_size",
        )
    if device.type not in ("cpu", "cuda"):
        raise InvalidRequestError(
            f"tensor_parallel_size {n}: device {device} (cpu or cuda only)", param="device"
        )


def fingerprint(model_dir: str, config: EngineConfig) -> str:
    """What every rank must agree on: the checkpoint's config.json and the world's settings."""
    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    h.update(repr((config.tensor_parallel_size, config.enable_expert_parallel)).encode())
    h.update(repr((config.dtype, config.block_size, config.max_model_len)).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class TorchrunWorld:
    """This process's place in a world `torchrun` started (its environment variables)."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    port: int
    #: torchrun's agent hosts the store (`TORCHELASTIC_USE_AGENT_STORE`): rank 0 joins it.
    agent_store: bool


def torchrun_world(env: Mapping[str, str] | None = None) -> TorchrunWorld | None:
    """The torchrun world of this process, or None when torchrun did not start it."""
    env = os.environ if env is None else env
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return TorchrunWorld(
        int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])), int(env["WORLD_SIZE"]),
        env["MASTER_ADDR"], int(env["MASTER_PORT"]),
        env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )  # fmt: skip


def _store(host: str, port: int, world_size: int, master: bool, timeout: Any) -> Any:
    """The world's store, every key under `metrale/`; `.port` is the TCP port."""
    tcp = dist.TCPStore(host, port, world_size, master, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore("metrale", tcp)
    return store, tcp.port


class Workers:
    """Rank 0's handle on the worker ranks (and their processes, when it spawned them)."""

    def __init__(
        self, ranks: list[int], procs: dict[int, subprocess.Popen[bytes]], store: Any
    ) -> None:
        self.ranks = ranks
        self.procs = procs
        self.store = store

    def dead(self) -> str:
        """The ranks whose process has exited, with their exit codes and messages (ranks
        torchrun started elsewhere: only the messages they left)."""
        gone = []
        for rank in self.ranks:
            proc = self.procs.get(rank)
            code = proc.poll() if proc is not None else None
            if code is not None:
                gone.append(f"rank {rank} exited with code {code}{self._message(rank)}")
            elif proc is None and self._message(rank):
                gone.append(f"rank {rank} failed{self._message(rank)}")
        return "; ".join(gone)

    def _message(self, rank: int) -> str:
        try:
            if self.store.check([f"error/{rank}"]):
                return f": {self.store.get(f'error/{rank}').decode()}"
        except RuntimeError:
            pass
        return ""

    def wait_for(self, key: str, deadline: float) -> None:
        """Until every worker has set `key/<rank>`; an exited worker or the deadline fails."""
        keys = [f"{key}/{rank}" for rank in self.ranks]
        while not self.store.check(keys):
            dead = self.dead()
            if dead:
                raise EngineDeadError(f"tensor parallel start-up failed: {dead}")
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"tensor parallel start-up: workers not '{key}' after {STARTUP_TIMEOUT_S:.0f}s"
                )
            time.sleep(0.02)

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()

    def join(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _worker_spec(
    config: EngineConfig, model_dir: str, rank: int, port: int, host: str = "127.0.0.1",
    local_rank: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {
        "rank": rank,
        "local_rank": rank if local_rank is None else local_rank,
        "world_size": config.tensor_parallel_size,
        "host": host,
        "port": port,
        "model_dir": model_dir,
        "config": dataclasses.asdict(config),
        "timeout_s": DEFAULT_TIMEOUT.total_seconds(),
    }


def load_tensor_parallel(
    config: EngineConfig, model_dir: str, progress: LoadProgress | None = None
) -> tuple[TransformerModel, LoadReport]:
    """Rank 0: the model sharded over `config.tensor_parallel_size` ranks of this host, its
    workers started, loaded and waiting for steps; `model.module` is the armed
    `TensorParallelModule` (its `close()` ends the workers)."""
    raw = read_config_json(model_dir)
    mcfg = parse_model_config(raw, str(Path(model_dir) / "config.json"))
    check_config(config, mcfg)
    device = resolve_device(config.device)
    n = config.tensor_parallel_size
    world = torchrun_world()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    if world is not None:
        if world.world_size != n or world.rank != 0:
            raise InvalidRequestError(
                f"tensor_parallel_size {n} under torchrun: the world has {world.world_size} "
                f"ranks and this is rank {world.rank}; the engine runs on rank 0 of a world of "
                "exactly tensor_parallel_size ranks",
                param="tensor_parallel_size",
            )
        store, port = _store(world.host, world.port, n, not world.agent_store, DEFAULT_TIMEOUT)
        where = f"torchrun world at {world.host}:{port}"
    else:
        store, port = _store("127.0.0.1", 0, n, True, DEFAULT_TIMEOUT)
        for rank in range(1, n):
            spec = json.dumps(_worker_spec(config, model_dir, rank, port))
            cmd = [sys.executable, "-m", "metrale.distributed.worker", spec]
            procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=dict(os.environ))
        pids = ", ".join(str(p.pid) for p in procs.values())
        where = f"workers pid {pids}, store port {port}"
    workers = Workers(list(range(1, n)), procs, store)
    finalizer = weakref.finalize(workers, Workers.kill, workers)
    logger.info(
        "tensor parallel: %d ranks (%s, %s backend), %s",
        n, device, "nccl" if device.type == "cuda" else "gloo", where,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        workers.wait_for("ready", deadline)
        tp = connect(0, n, device, store=store, timeout=DEFAULT_TIMEOUT)
        workers.wait_for("fingerprint", deadline)
        mine = fingerprint(model_dir, config)
        for rank in procs:
            theirs = store.get(f"fingerprint/{rank}").decode()
            if theirs != mine:
                raise EngineDeadError(
                    f"tensor parallel rank {rank} sees another model or config than rank 0 "
                    f"({model_dir}: fingerprint {theirs[:12]} vs {mine[:12]})"
                )
        try:
            model, report = load_model(
                config,
                model_dir,
                progress,
                sharding=RankSharding(tp, config.enable_expert_parallel),
            )
        except (RuntimeError, MetraleError) as exc:
            time.sleep(0.2)  # a worker's own error reaches the store just before it exits
            dead = workers.dead()
            if dead:
                raise EngineDeadError(f"tensor parallel start-up failed: {dead}") from exc
            raise
    except BaseException:
        finalizer()
        raise
    module = model.module
    assert isinstance(module, TensorParallelModule)
    module.health = workers.dead
    module.armed = True
    module.on_close = lambda: (workers.join(), finalizer.detach())
    return model, report


def worker_main(spec: dict[str, Any]) -> int:
    """A worker rank: join the world, load this rank's share in lockstep with rank 0, then
    run rank 0's steps until it says stop (or is gone). Returns the exit code."""
    rank, n = int(spec["rank"]), int(spec["world_size"])
    timeout = datetime.timedelta(seconds=float(spec["timeout_s"]))
    config = EngineConfig(**spec["config"])
    model_dir = spec["model_dir"]
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(spec["local_rank"]) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    store, _ = _store(spec["host"], int(spec["port"]), n, False, timeout)
    store.set(f"ready/{rank}", "1")
    tp = connect(rank, n, device, store=store, timeout=timeout)
    try:
        store.set(f"fingerprint/{rank}", fingerprint(model_dir, config))
        model, _ = load_model(
            config, model_dir, sharding=RankSharding(tp, config.enable_expert_parallel)
        )
    except Exception as exc:
        store.set(f"error/{rank}", f"{type(exc).__name__}: {exc}")
        raise
    module = model.module
    assert isinstance(module, TensorParallelModule)
    try:
        steps = serve_steps(module, model.main_kv_layers, model.dtype)
    except RuntimeError as exc:
        # Rank 0 gone (its process ended, or crashed: its own exit status says which).
        logger.info("tensor parallel rank %d: rank 0 gone (%s); exiting", rank, exc)
        return 0
    except Exception as exc:  # this rank's own failure: rank 0 names it from the store
        store.set(f"error/{rank}", f"step failed: {type(exc).__name__}: {exc}")
        raise
    logger.info("tensor parallel rank %d: stopped after %d steps", rank, steps)
    return 0


def torchrun_worker(config: EngineConfig, model_dir: str, world: TorchrunWorld) -> int:
    """A rank above 0 of a torchrun world (`metrale serve|generate ...` under torchrun): this
    rank's share of the engine's model, serving rank 0's steps until it stops."""
    if world.world_size != config.tensor_parallel_size:
        raise InvalidRequestError(
            f"torchrun started {world.world_size} ranks but tensor_parallel_size is "
            f"{config.tensor_parallel_size}",
            param="tensor_parallel_size",
        )
    spec = _worker_spec(config, model_dir, world.rank, world.port, world.host, world.local_rank)
    return worker_main(spec)
