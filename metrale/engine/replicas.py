"""`ReplicatedEngine`: N engine replicas (data parallelism) behind one engine handle.

Owner: engine. `metrale serve --data-parallel-size N` builds N replicas, each an `EngineProcess`
(its own process, its own model copy and KV pool) watched by a `SupervisedEngine`, and hands the
server one `ReplicatedEngine`: it implements the `EngineHandle` protocol the routes already use,
so nothing above it changes. Each add goes to the replica `PrefixRouter` (`router.py`) picks:
the one recorded to hold the prompt's longest cached prefix, unless it carries more than
`load_margin` outstanding requests over the least loaded one. Devices: on CUDA replica i gets
the i-th visible GPU (its process sees only that one, `CUDA_VISIBLE_DEVICES`); on the CPU the
replicas share the cores, each process's torch threads set to an equal share
(`OMP_NUM_THREADS`, unless the environment sets it) (`replica_envs`).

Invariants:
- All replicas serve the same model: at construction their `EngineInfo`s must agree on every
  field but the KV pool size (the vision front end: on whether there is one), or it is a
  `MetraleError` naming the field and the replicas.
- A stream stays bound to the replica that accepted it (its aborts go there). A replica that
  dies fails its own in-flight requests with `EngineDeadError` (its handle's rule) and is
  skipped by the router until its supervisor has restarted it (unless restarts are off: then
  it stays out); the router's record of it is dropped, since its cache is gone. The server
  keeps serving on the others; only when no replica is available does `dead_error` say so
  (503). An add refused because its replica died meanwhile is retried on another replica.
- Control calls (the LoRA registry) reach every available replica; a load is sent only to
  replicas that do not hold the same adapter (name, path, id) yet, so the server's reload of
  runtime adapters after a restart reaches just the restarted replica.
- `snapshot` sums the replicas' gauges and counters (`alive`: any replica alive);
  `replica_stats` gives them per replica (with the router's counters) for `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from metrale.engine.handle import EngineHandle, RequestStream
from metrale.engine.router import DEFAULT_LOAD_MARGIN, PrefixRouter, block_hashes
from metrale.engine.snapshot import EngineInfo, EngineSnapshot
from metrale.errors import EngineDeadError, InvalidRequestError, MetraleError
from metrale.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

#: `EngineInfo` fields the replicas may differ in (each sizes its own KV pool from its memory).
_PER_REPLICA_INFO = frozenset({"num_total_blocks"})
#: `EngineInfo` fields compared by presence only (objects without value equality, built from
#: the same checkpoint in each replica).
_PRESENCE_INFO = frozenset({"vision"})


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's figures for `/metrics` (labelled `replica`)."""

    index: int
    device: str
    alive: bool
    open_requests: int
    restarts: int
    #: Requests the router sent here, by reason ("prefix" / "load").
    routed_prefix: int
    routed_load: int
    #: Prompt tokens the router expected this replica's cache to hold for them.
    routed_matched_tokens: int
    #: Block hashes the router remembers for this replica.
    recorded_blocks: int
    snapshot: EngineSnapshot


def sum_snapshots(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """One snapshot of several engines: numbers summed, dicts summed by key, lists summed
    position by position, nested dataclasses likewise, None (an optional figure an engine
    lacks) left out; `alive` when any engine is alive."""
    if not snapshots:
        return EngineSnapshot(alive=False)
    total = _sum_values(list(snapshots))
    return replace(total, alive=any(s.alive for s in snapshots))


def _sum_values(values: list[Any]) -> Any:
    values = [v for v in values if v is not None]  # an optional figure some engines lack
    if not values:
        return None
    first = values[0]
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, int | float):
        return sum(values)
    if isinstance(first, dict):
        keys: dict[Any, None] = {}
        for value in values:
            keys.update(dict.fromkeys(value))
        return {k: _sum_values([v[k] for v in values if k in v]) for k in keys}
    if isinstance(first, list):
        width = max(len(v) for v in values)
        return [sum(v[i] for v in values if i < len(v)) for i in range(width)]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        summed = {
            f.name: _sum_values([getattr(v, f.name) for v in values])
            for f in dataclasses.fields(first)
        }
        return type(first)(**summed)
    return first


def check_same_model(infos: Sequence[EngineInfo]) -> None:
    """Refuse replicas that do not serve the same model and settings."""
    first = infos[0]
    for index, info in enumerate(infos[1:], start=1):
        for f in dataclasses.fields(EngineInfo):
            if f.name in _PER_REPLICA_INFO:
                continue
            mine, theirs = getattr(first, f.name), getattr(info, f.name)
            if f.name in _PRESENCE_INFO:
                mine, theirs = mine is not None, theirs is not None
            if mine != theirs:
                raise MetraleError(
                    f"data-parallel replicas 0 and {index} differ in {f.name} "
                    f"({mine!r} vs {theirs!r}); every replica must serve the same model"
                )


def replica_envs(
    device: str,
    num_replicas: int,
    *,
    environ: Mapping[str, str] | None = None,
    cuda_count: Callable[[], int] | None = None,
    cpu_count: int | None = None,
) -> list[dict[str, str]]:
    """The environment each replica's process starts with: on CUDA (`device` "cuda", or
    "auto" with a GPU), `CUDA_VISIBLE_DEVICES` naming its one GPU (the i-th of those this
    process sees); on the CPU, `OMP_NUM_THREADS` = an equal share of the cores, unless the
    environment already sets it. Too few GPUs is an `InvalidRequestError`."""
    env = os.environ if environ is None else environ
    if cuda_count is None:

        def cuda_count() -> int:
            import torch

            return torch.cuda.device_count() if torch.cuda.is_available() else 0

    gpus = cuda_count() if device in ("cuda", "auto") else 0
    if device == "cuda" or (device == "auto" and gpus > 0):
        if gpus < num_replicas:
            raise InvalidRequestError(
                f"--data-parallel-size {num_replicas} needs {num_replicas} GPUs (one per "
                f"replica); {gpus} visible",
                param="data_parallel_size",
            )
        visible = env.get("CUDA_VISIBLE_DEVICES")
        names = (
            [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpus)]
        )
        return [{"CUDA_VISIBLE_DEVICES": names[i]} for i in range(num_replicas)]
    if "OMP_NUM_THREADS" in env:
        return [{} for _ in range(num_replicas)]
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    share = str(max(1, cores // num_replicas))
    return [{"OMP_NUM_THREADS": share} for _ in range(num_replicas)]


def build_replicas(factories: Sequence[Callable[[], EngineHandle]]) -> list[EngineHandle]:
    """Build every replica at once (each loads its model in its own process); if one fails,
    shut the others down and raise its error."""
    with ThreadPoolExecutor(max_workers=len(factories), thread_name_prefix="metrale-dp") as pool:
        futures = [pool.submit(factory) for factory in factories]
        built, errors = [], []
        for future in futures:
            try:
                built.append(future.result())
            except BaseException as exc:
                errors.append(exc)
    if errors:
        for handle in built:
            with contextlib.suppress(Exception):
                handle.shutdown(5.0)
        raise errors[0]
    return built


class ReplicatedEngine:
    """An `EngineHandle` over N replica handles, routing each add (module docstring)."""

    def __init__(
        self,
        replicas: Sequence[EngineHandle],
        *,
        load_margin: int = DEFAULT_LOAD_MARGIN,
        router_capacity: int | None = None,
    ) -> None:
        if not replicas:
            raise ValueError("ReplicatedEngine needs at least one replica")
        self.replicas = list(replicas)
        infos = [r.info for r in self.replicas]
        check_same_model(infos)
        self.info: EngineInfo = replace(
            infos[0], num_total_blocks=sum(i.num_total_blocks for i in infos)
        )
        self.tokenizer = self.replicas[0].tokenizer
        self.block_size = infos[0].kv_block_size or 16
        capacity = router_capacity or max(1, min(i.num_total_blocks for i in infos))
        self.router = PrefixRouter(len(self.replicas), capacity=capacity, load_margin=load_margin)
        self._lock = threading.Lock()
        #: Adds routed to each replica and not answered yet (part of its load).
        self._pending = [0] * len(self.replicas)
        #: Restart count of each replica when last looked at (a change: its cache is gone).
        self._seen_restarts = [self._restarts_of(r) for r in self.replicas]
        self._was_available = [True] * len(self.replicas)
        self._routed = [{"prefix": 0, "load": 0} for _ in self.replicas]
        self._matched_tokens = [0] * len(self.replicas)
        #: Runtime LoRA adapters each replica holds, name -> (path, id), as sent by `control`.
        self._loras: list[dict[str, tuple[str, int]]] = [{} for _ in self.replicas]

    # ----------------------------------------------------------------- lifecycle

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def is_running(self) -> bool:
        return any(self._available(r) for r in self.replicas)

    @property
    def dead_error(self) -> MetraleError | None:
        if self.is_running:
            return None
        first = next((r.dead_error for r in self.replicas if r.dead_error is not None), None)
        detail = first.message if first is not None else "not running"
        return EngineDeadError(
            f"all {self.num_replicas} data-parallel replicas are down ({detail})"
        )

    @property
    def restarts(self) -> int:
        """Restarts of all replicas together (`metrale_engine_restarts_total`)."""
        return sum(self._restarts_of(r) for r in self.replicas)

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def begin_drain(self, message: str = "the server is shutting down") -> None:
        for replica in self.replicas:
            replica.begin_drain(message)

    def abort_all(self, message: str) -> None:
        for replica in self.replicas:
            replica.abort_all(message)

    def shutdown(self, timeout: float = 10.0) -> None:
        for replica in self.replicas:
            replica.begin_drain()
        threads = [
            threading.Thread(target=r.shutdown, args=(timeout,), daemon=True) for r in self.replicas
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout + 10.0)

    def snapshot(self) -> EngineSnapshot:
        return sum_snapshots([self._snapshot_of(r) for r in self.replicas])

    @staticmethod
    def _snapshot_of(replica: EngineHandle) -> EngineSnapshot:
        """The replica's snapshot; one that has sent none yet (it never ran a request)
        counts its whole pool as free."""
        snap = replica.snapshot()
        if snap.num_total_blocks == 0 and snap.num_steps == 0:
            blocks = replica.info.num_total_blocks
            snap = replace(snap, num_total_blocks=blocks, num_free_blocks=blocks)
        return snap

    def num_open_requests(self) -> int:
        return sum(r.num_open_requests() for r in self.replicas)

    def _submit_abort(self, request_id: str) -> None:
        # Streams abort through the replica that accepted them; this reaches a request whose
        # add was cancelled before the router knew its replica's answer (an unknown id is a
        # no-op for an engine).
        for replica in self.replicas:
            replica._submit_abort(request_id)

    def replica_stats(self) -> list[ReplicaStats]:
        with self._lock:
            routed = [dict(r) for r in self._routed]
            matched = list(self._matched_tokens)
            recorded = [self.router.recorded_blocks(i) for i in range(self.num_replicas)]
        return [
            ReplicaStats(
                index=i,
                device=replica.info.device,
                alive=self._available(replica),
                open_requests=replica.num_open_requests(),
                restarts=self._restarts_of(replica),
                routed_prefix=routed[i]["prefix"],
                routed_load=routed[i]["load"],
                routed_matched_tokens=matched[i],
                recorded_blocks=recorded[i],
                snapshot=self._snapshot_of(replica),
            )
            for i, replica in enumerate(self.replicas)
        ]

    # -------------------------------------------------------------------- intake

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        adapter_id: int = 0,
        cache_namespace: str | None = None,
        **options: Any,
    ) -> RequestStream:
        """The chosen replica's `add_request`: the keywords the route reads (the prompt's
        ids, its adapter, its cache namespace) are named, the others (`options`) pass to the
        replica unread, so their defaults live only there. An add refused because that
        replica died is tried on the next choice, until no replica is left."""
        hashes = block_hashes(
            self._prompt_ids(prompt, prompt_token_ids), self.block_size,
            adapter_id=adapter_id, cache_namespace=cache_namespace,
        )  # fmt: skip
        tried: set[int] = set()
        while True:
            index = self._route(hashes, exclude=tried)
            replica = self.replicas[index]
            try:
                return await replica.add_request(
                    request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                    adapter_id=adapter_id, cache_namespace=cache_namespace, **options,
                )  # fmt: skip
            except EngineDeadError:
                if replica.dead_error is None or self._available_count(tried | {index}) == 0:
                    raise  # draining, or no other replica to try
                logger.warning("replica %d died while accepting %s; trying another", index,
                               request_id)  # fmt: skip
                tried.add(index)
            finally:
                with self._lock:
                    self._pending[index] -= 1

    def _prompt_ids(
        self, prompt: str | Sequence[int] | None, prompt_token_ids: Sequence[int] | None
    ) -> Sequence[int]:
        if prompt_token_ids is not None:
            return prompt_token_ids
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return prompt or ()

    def _route(self, hashes: Sequence[int], exclude: set[int]) -> int:
        """Pick a replica (counted as pending until its add is answered)."""
        with self._lock:
            available = [
                self._check_replica(i) and i not in exclude for i in range(self.num_replicas)
            ]
            if not any(available):
                error = self.dead_error or EngineDeadError("no data-parallel replica can take it")
                raise copy.copy(error)
            loads = [r.num_open_requests() + self._pending[i] for i, r in enumerate(self.replicas)]
            decision = self.router.choose(hashes, loads, available)
            index = decision.replica
            self.router.record(index, hashes)
            self._pending[index] += 1
            self._routed[index][decision.reason] += 1
            self._matched_tokens[index] += decision.matched_blocks * self.block_size
        return index

    def _available_count(self, exclude: set[int]) -> int:
        return sum(
            1 for i, r in enumerate(self.replicas) if i not in exclude and self._available(r)
        )

    def _check_replica(self, index: int) -> bool:
        """Under `_lock`: whether replica `index` may take requests; a replica that died or
        restarted since the last look loses the router's record (and its adapters)."""
        replica = self.replicas[index]
        available = self._available(replica)
        restarts = self._restarts_of(replica)
        if restarts != self._seen_restarts[index] or (not available and self._was_available[index]):
            self.router.forget(index)
            self._loras[index].clear()
            self._seen_restarts[index] = restarts
            if not available:
                logger.error("data-parallel replica %d is down; routing to the others", index)
        if available and not self._was_available[index]:
            logger.warning("data-parallel replica %d is serving again", index)
        self._was_available[index] = available
        return available

    @staticmethod
    def _available(replica: EngineHandle) -> bool:
        return replica.dead_error is None and replica.is_running

    @staticmethod
    def _restarts_of(replica: EngineHandle) -> int:
        return int(getattr(replica, "restarts", 0) or 0)

    # ------------------------------------------------------------------- control

    async def control(self, method: str, *args: Any) -> Any:
        """A LoRA registry call on every available replica (a list: on the first); the first
        replica's result, or the first error any replica raised."""
        with self._lock:
            targets = [i for i in range(self.num_replicas) if self._check_replica(i)]
        if not targets:
            raise copy.copy(self.dead_error or EngineDeadError("no replica is running"))
        if method == "lora_adapter_list":
            return await self.replicas[targets[0]].control(method, *args)
        known: dict[int, Any] = {}
        if method == "load_lora_adapter":
            name, path = args[0], str(args[1])
            adapter_id = args[2] if len(args) > 2 else None
            for i in targets:
                held = self._loras[i].get(name)
                if held is not None and held[0] == path and adapter_id in (None, held[1]):
                    known[i] = held[1]
        sent = [i for i in targets if i not in known]
        answers = await asyncio.gather(
            *(self.replicas[i].control(method, *args) for i in sent), return_exceptions=True
        )
        results = dict(known)
        error: BaseException | None = None
        for i, answer in zip(sent, answers, strict=True):
            if isinstance(answer, BaseException):
                logger.error("replica %d refused %s: %s", i, method, answer)
                error = error or answer
                continue
            results[i] = answer
            with self._lock:
                if method == "load_lora_adapter":
                    self._loras[i][args[0]] = (str(args[1]), int(answer))
                elif method == "unload_lora_adapter":
                    self._loras[i].pop(args[0], None)
        if error is not None:
            raise error
        return results[targets[0]]
