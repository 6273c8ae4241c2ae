"""The tensor-parallel world of one engine: its ranks, its two process groups and the few
collectives the sharded layers and the step protocol use.

Owner: distributed. A `TensorParallel` is built once per process by `connect` and handed
explicitly to everything that needs it (the sharded layers' hooks, the vocab-parallel
embedding, the rank module, the worker loop); there is no module-level state and torch's
default process group is never created, so one process could hold several worlds.

Invariants:
- Two groups over one `TCPStore`: `group` runs the model's collectives (NCCL on CUDA, gloo on
  the CPU; every op bounded by `timeout`, so a dead peer ends a collective with an error, not a
  hang), `control` (always gloo, CPU tensors) carries rank 0's step commands; a worker waits on
  it with `IDLE_TIMEOUT`, since an idle server sends nothing for hours.
- Every rank calls the same collectives in the same order (SPMD); rank 0 (`is_driver`) is the
  only rank that samples and the only one that talks to the scheduler.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: How long a worker waits for rank 0's next command (an idle server sends none).
IDLE_TIMEOUT = datetime.timedelta(days=30)
#: Default bound of one model collective and of start-up rendezvous steps.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass
class TensorParallel:
    """One rank's view of the tensor-parallel world."""

    rank: int
    world_size: int
    device: torch.device
    #: The model's collectives (NCCL on CUDA, gloo on the CPU).
    group: Any
    #: Rank 0's commands (gloo, CPU tensors).
    control: Any
    store: Any
    timeout: datetime.timedelta

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        self.group.allreduce([tensor]).wait()
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' `[rows, n]` tensors side by side: `[rows, world_size * n]`, on every rank."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` into every rank's (a model-group broadcast, device tensors)."""
        self.group.broadcast(tensor, 0, self.timeout).wait()
        return tensor

    def send_command(self, tensor: torch.Tensor, *, idle: bool = False) -> torch.Tensor:
        """Rank 0's CPU `tensor` into every rank's over the control group; `idle`: a worker
        waiting for the next step (no deadline but the process's liveness)."""
        self.control.broadcast(tensor, 0, IDLE_TIMEOUT if idle else self.timeout).wait()
        return tensor


def connect(
    rank: int,
    world_size: int,
    device: torch.device,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    store: Any = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> TensorParallel:
    """This rank's `TensorParallel`: joins (or, given `store`, reuses) the TCP store at
    `host:port`, then builds both groups once every rank has arrived."""
    if store is None:
        store = dist.TCPStore(
            host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False
        )
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, world_size, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout
        options.global_ranks_in_group = list(range(world_size))
        options.group_name = "metrale-tensor-parallel"
        group: Any = dist.ProcessGroupNCCL(
            dist.PrefixStore("nccl", store), rank, world_size, options
        )
    else:
        group = dist.ProcessGroupGloo(dist.PrefixStore("model", store), rank, world_size, timeout)
    return TensorParallel(rank, world_size, device, group, control, store, timeout)
