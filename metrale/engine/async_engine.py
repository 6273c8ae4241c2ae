"""`AsyncEngine`: the `Engine` on its own thread, behind asyncio.

Owner: engine. The server talks to the engine only through this class: `add_request` returns a
`RequestStream` (an async iterator of cumulative `RequestOutput`s), `RequestStream.abort` ends
a request early, `snapshot` gives the gauges and counters the metrics read (speculative
decoding's included), `begin_drain` / `abort_all` / `shutdown` serve a graceful exit.

Invariants:
- Only the engine thread touches the `Engine` (add, abort, step). Other threads and the event
  loop reach it through a locked inbox of commands, applied between steps in arrival order.
- An abort (client disconnect, cancellation) is applied at the next loop turn, before the next
  step, so the request's KV blocks are free long before it would have finished.
- Each request's outputs reach its asyncio queue through `loop.call_soon_threadsafe`, one call
  per event loop per step carrying every output of that step (one wakeup of the loop, not one
  per request: at 128 streams the per-request wakeups were the engine thread's largest cost); the last
  item a stream yields is a finished `RequestOutput` or an exception, never nothing: errors
  raised by `Engine.add_request` reach the awaiting caller, a crash of the engine loop reaches
  every open stream as `EngineDeadError` and refuses new requests with it.
- When there is no work the thread sleeps on a condition variable (no busy spin).
- `add_request` hands every argument of `Engine.add_request` the server sets (prompt, params,
  timeout, adapter, `speculative`, `lookup_tenant`) through unchanged.
- `EngineSnapshot` is picklable (it crosses `EngineProcess`'s pipe): plain values and copies,
  never live engine objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from metrale.config import EngineConfig
from metrale.engine.engine import DEFAULT_TENANT, Engine
from metrale.engine.request import RequestOutput
from metrale.errors import EngineDeadError, MetraleError
from metrale.sampling.defaults import SamplingDefaults
from metrale.sampling.params import SamplingParams
from metrale.scheduler.core import SchedulerStats
from metrale.spec.stats import SpecStats
from metrale.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How long the loop waits before retrying when unfinished requests made no progress in a step
#: (e.g. every waiting request is held back); bounds the spin rate of that rare case.
_STALL_WAIT_S = 0.005
#: Least time between two walks of the prefix cache for the cache-only block count while busy.
_CACHE_SCAN_INTERVAL_S = 0.25


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges and counters as of the last loop turn (read by `/metrics`)."""

    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_requests: int = 0
    num_free_blocks: int = 0
    #: Blocks held only by the prefix cache (reclaimable on demand; refreshed at most every
    #: `_CACHE_SCAN_INTERVAL_S` while busy, exactly whenever the engine is idle).
    num_cache_only_blocks: int = 0
    num_total_blocks: int = 0
    num_steps: int = 0
    #: Steps launched on the device token feed / fed-eligible steps drained first.
    fed_steps: int = 0
    drained_steps: int = 0
    alive: bool = True
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    #: The model's prefix-cache counters (`Model.prefix_cache_stats`: evictions, bypasses).
    prefix_cache: dict[str, int] = field(default_factory=dict)
    #: Forwards replayed from a CUDA graph, and forwards run eagerly.
    graph_forwards: int = 0
    eager_forwards: int = 0
    #: Speculative decoding counters (`Engine.spec_stats`; all zero when speculation is off).
    spec: SpecStats = field(default_factory=SpecStats)
    #: The throughput gate's switch counts (`SpecGate.counters`: global_off, global_on,
    #: row_off, row_on); empty when there is no gate.
    spec_gate: dict[str, int] = field(default_factory=dict)
    #: Drafts per verify row (k); 0 when speculation is off.
    num_speculative_tokens: int = 0


class SnapshotTaker:
    """Reads an `Engine`'s gauges into an `EngineSnapshot` (on the engine's own thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cache_only = 0
        self._cache_scanned_at = float("-inf")

    def take(self, alive: bool = True) -> EngineSnapshot:
        engine = self.engine
        scheduler = engine.scheduler
        return EngineSnapshot(
            num_waiting=len(scheduler.waiting),
            num_running=len(scheduler.running),
            num_swapped=len(scheduler.swapped),
            num_requests=len(engine.requests),
            num_free_blocks=engine.model.num_free_blocks(),
            num_cache_only_blocks=self._cache_only_blocks(idle=not engine.requests),
            num_total_blocks=engine.model.num_total_blocks(),
            num_steps=engine.num_steps,
            fed_steps=engine.fed_steps,
            drained_steps=engine.drained_steps,
            alive=alive,
            stats=copy.deepcopy(scheduler.stats),
            prefix_cache=dict(engine.model.prefix_cache_stats()),
            graph_forwards=int(getattr(getattr(engine.model, "graph_runner", None), "replays", 0)),
            eager_forwards=int(getattr(engine.model, "eager_forwards", 0)),
            spec=copy.deepcopy(engine.spec_stats),
            spec_gate=dict(engine.spec_gate.counters) if engine.spec_gate is not None else {},
            num_speculative_tokens=engine.num_speculative_tokens,
        )

    def _cache_only_blocks(self, idle: bool) -> int:
        cache = getattr(self.engine.model, "prefix_cache", None)
        if cache is None:
            return 0
        now = time.monotonic()
        if idle or now - self._cache_scanned_at >= _CACHE_SCAN_INTERVAL_S:
            self._cache_only = int(cache.cache_only_blocks())
            self._cache_scanned_at = now
        return self._cache_only


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of a loaded engine (picklable: it crosses processes)."""

    served_model_name: str
    model_dir: str
    max_model_len: int
    device: str
    dtype: str
    num_total_blocks: int
    kv_block_size: int
    #: The checkpoint's generation_config.json sampling defaults (empty when not used).
    sampling_defaults: SamplingDefaults


def engine_info(engine: Engine) -> EngineInfo:
    model = engine.model
    return EngineInfo(
        served_model_name=engine.served_model_name,
        model_dir=engine.model_dir,
        max_model_len=engine.max_model_len,
        device=str(getattr(model, "device", engine.config.device)),
        dtype=str(getattr(model, "dtype", engine.config.dtype)).removeprefix("torch."),
        num_total_blocks=model.num_total_blocks(),
        kv_block_size=model.kv_block_size() or 0,
        sampling_defaults=engine.sampling_defaults,
    )


class EngineHandle(Protocol):
    """What the server holds: `AsyncEngine` (a thread) or `EngineProcess` (a child process)."""

    info: EngineInfo
    tokenizer: Tokenizer

    @property
    def is_running(self) -> bool: ...
    @property
    def dead_error(self) -> MetraleError | None: ...
    def start(self) -> None: ...
    def begin_drain(self, message: str = ...) -> None: ...
    def abort_all(self, message: str) -> None: ...
    def shutdown(self, timeout: float = ...) -> None: ...
    def snapshot(self) -> EngineSnapshot: ...
    def num_open_requests(self) -> int: ...
    def _submit_abort(self, request_id: str) -> None: ...
    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        adapter_id: int = 0,
        speculative: bool = True,
        lookup_tenant: str | None = DEFAULT_TENANT,
    ) -> RequestStream: ...


class RequestStream:
    """The outputs of one request, as the engine produces them.

    Iterating yields cumulative `RequestOutput`s; when the consumer falls behind, outputs
    already superseded are skipped (each output holds everything before it), so a slow client
    never slows the engine. Iteration ends after the finished output, or raises the error that
    ended the request. Leaving early must call `abort` (the `async with` form does).
    """

    def __init__(self, request_id: str, engine: EngineHandle, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def _post(self, item: RequestOutput | BaseException) -> None:
        """Hand `item` to the consumer; callable from any thread."""
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
            while not isinstance(item, BaseException) and not item.finished:
                try:
                    item = self._queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
        except BaseException:  # cancelled while waiting: the consumer is gone
            self.abort()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def abort(self) -> None:
        """End the request now (idempotent; no more outputs follow)."""
        if not self._done:
            self._done = True
            self._engine._submit_abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the streams' event loop: queue each output for its stream."""
    for stream, output in items:
        stream._queue.put_nowait(output)


@dataclass
class _Add:
    request_id: str
    prompt: str | Sequence[int] | None
    params: SamplingParams
    prompt_token_ids: Sequence[int] | None
    timeout: float | None
    adapter_id: int
    speculative: bool
    lookup_tenant: str | None
    stream: RequestStream
    accepted: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    error: MetraleError


_Command = _Add | _Abort | _AbortAll


def post_by_loop(
    items: Iterable[tuple[asyncio.AbstractEventLoop, T]], apply: Callable[[list[T]], None]
) -> None:
    """Hand `items` to their event loops: one `call_soon_threadsafe(apply, group)` per loop
    (one wakeup of each loop, whatever the number of items)."""
    groups: dict[asyncio.AbstractEventLoop, list[T]] = {}
    for loop, item in items:
        groups.setdefault(loop, []).append(item)
    for loop, group in groups.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            loop.call_soon_threadsafe(apply, group)


def settle_future(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Resolve `future` (on its loop's thread) unless its waiter already gave up."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._draining: MetraleError | None = None
        self._dead: MetraleError | None = None
        self._snapshot_lock = threading.Lock()
        self._snapshot = EngineSnapshot()
        self._snapshots = SnapshotTaker(engine)
        #: Outputs delivered so far (progress, for the stall check).
        self._delivered = 0
        self._update_snapshot()
        self.info = engine_info(engine)
        self.tokenizer = engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    # ----------------------------------------------------------------- lifecycle

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> MetraleError | None:
        return self._dead

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="metrale-engine", daemon=True)
        self._thread.start()

    def begin_drain(self, message: str = "the server is shutting down") -> None:
        """Refuse new requests (503); requests already accepted keep running."""
        with self._cond:
            if self._draining is None:
                self._draining = EngineDeadError(message)

    def abort_all(self, message: str) -> None:
        """End every open request with an `EngineDeadError(message)` (their KV freed)."""
        self._submit(_AbortAll(EngineDeadError(message)))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop: open requests end with an error, the thread exits."""
        self.begin_drain()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def snapshot(self) -> EngineSnapshot:
        with self._snapshot_lock:
            return self._snapshot

    def num_open_requests(self) -> int:
        return len(self._streams)

    # -------------------------------------------------------------------- intake

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        adapter_id: int = 0,
        speculative: bool = True,
        lookup_tenant: str | None = DEFAULT_TENANT,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it, or raises why it did not.

        `speculative` and `lookup_tenant` are `Engine.add_request`'s: the per-request opt-out
        of speculative decoding, and the cross-request draft lookup's partition."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        accepted: asyncio.Future[None] = loop.create_future()
        command = _Add(
            request_id=request_id,
            prompt=prompt,
            params=params,
            prompt_token_ids=prompt_token_ids,
            timeout=timeout,
            adapter_id=adapter_id,
            speculative=speculative,
            lookup_tenant=lookup_tenant,
            stream=stream,
            accepted=accepted,
            loop=loop,
        )
        self._submit(command)
        try:
            await accepted
        except asyncio.CancelledError:
            self._submit_abort(request_id)  # it may have been added meanwhile
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, params, **kwargs)
        async with stream:
            async for output in stream:
                yield output

    def _submit(self, command: _Command) -> None:
        with self._cond:
            refusal = self._dead or (self._draining if isinstance(command, _Add) else None)
            if refusal is None and self._stop and isinstance(command, _Add):
                refusal = EngineDeadError("the engine has shut down")
            if refusal is not None:
                if isinstance(command, _Add):
                    raise copy.copy(refusal)
                return
            self._inbox.append(command)
            self._cond.notify()

    def _submit_abort(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    # ------------------------------------------------------------- engine thread

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:
            logger.exception("the engine loop crashed; refusing all further requests")
            self._die(EngineDeadError(f"the engine loop stopped: {type(exc).__name__}: {exc}"))
            return
        self._die(EngineDeadError("the engine has shut down"))

    def _loop_forever(self) -> None:
        engine = self.engine
        stalled = False
        while True:
            with self._cond:
                if stalled and not self._inbox and not self._stop:
                    self._cond.wait(_STALL_WAIT_S)
                while not self._inbox and not self._stop and not engine.has_unfinished():
                    self._cond.wait()
                commands, self._inbox = self._inbox, []
                stop = self._stop
            for command in commands:
                self._apply(command)
            if stop:
                return
            stalled = False
            if engine.has_unfinished():
                steps_before, delivered_before = engine.num_steps, self._delivered
                outputs = engine.step(on_outputs=self._deliver)
                self._deliver(outputs)
                stalled = self._delivered == delivered_before and engine.num_steps == steps_before
            self._update_snapshot()

    def _apply(self, command: _Command) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            error: BaseException | None = None
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    prompt_token_ids=command.prompt_token_ids,
                    timeout=command.timeout,
                    adapter_id=command.adapter_id,
                    speculative=command.speculative,
                    lookup_tenant=command.lookup_tenant,
                )
            except Exception as exc:  # MetraleError for bad requests; anything else: a bug
                error = exc
            else:
                self._streams[command.request_id] = command.stream
            try:
                command.loop.call_soon_threadsafe(settle_future, command.accepted, error)
            except RuntimeError:  # the caller's loop is gone: nobody will read this request
                if error is None:
                    self._abort(command.request_id, None)
        elif isinstance(command, _Abort):
            self._abort(command.request_id, None)
        else:
            for request_id in list(self._streams):
                self._abort(request_id, command.error)

    def _abort(self, request_id: str, error: MetraleError | None) -> None:
        output = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if error is not None:
            stream._post(copy.copy(error))
        elif output is not None:
            stream._post(output)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Post a step's outputs: one `call_soon_threadsafe` per event loop."""
        self._delivered += len(outputs)
        items = []
        for output in outputs:
            stream = (
                self._streams.pop(output.request_id, None)
                if output.finished
                else self._streams.get(output.request_id)
            )
            if stream is not None:
                items.append((stream._loop, (stream, output)))
        post_by_loop(items, _put_all)

    def _die(self, error: EngineDeadError) -> None:
        with self._cond:
            self._dead = error
            pending, self._inbox = self._inbox, []
        for command in pending:
            if isinstance(command, _Add):
                with contextlib.suppress(RuntimeError):
                    command.loop.call_soon_threadsafe(
                        settle_future, command.accepted, copy.copy(error)
                    )
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # the engine may be broken; the client still gets its error
                logger.debug("abort of %s failed after the loop stopped", request_id)
            stream._post(copy.copy(error))
        self._streams.clear()
        try:
            self._update_snapshot(alive=False)
        except Exception:
            with self._snapshot_lock:
                self._snapshot = EngineSnapshot(alive=False)

    def _update_snapshot(self, alive: bool = True) -> None:
        snap = self._snapshots.take(alive)
        with self._snapshot_lock:
            self._snapshot = snap
