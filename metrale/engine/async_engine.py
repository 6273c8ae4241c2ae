"""`AsyncEngine`: the `Engine` on its own thread, behind asyncio.

Owner: engine. The thread transport of the engine handle (`metrale.engine.handle`): the rules
of intake, delivery and death live in `HandleBase`; this class adds the engine thread and its
inbox. `add_request` returns a `RequestStream` (an async iterator of cumulative
`RequestOutput`s), `RequestStream.abort` ends a request early, `snapshot` gives the gauges and
counters the metrics read (speculative decoding's included), `begin_drain` / `abort_all` /
`shutdown` serve a graceful exit. The handle's types are re-exported here for importers.

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
  timeout, adapter, `speculative`, `lookup_tenant`, `cache_namespace`, `priority`, `session_id`) through
  unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
from dataclasses import dataclass

from metrale.config import EngineConfig
from metrale.engine.cpu_threads import apply_engine_threads
from metrale.engine.engine import Engine
from metrale.engine.handle import (
    STALL_WAIT_S,
    ControlCall,
    EngineHandle,
    HandleBase,
    RequestStream,
    Submission,
    apply_control,
    post_by_loop,
    settle_future,
)
from metrale.engine.request import RequestOutput
from metrale.engine.snapshot import EngineInfo, EngineSnapshot, SnapshotTaker, engine_info
from metrale.errors import EngineDeadError, MetraleError

__all__ = [
    "AsyncEngine",
    "EngineHandle",
    "EngineInfo",
    "EngineSnapshot",
    "RequestStream",
    "SnapshotTaker",
    "engine_info",
    "post_by_loop",
    "settle_future",
]

logger = logging.getLogger(__name__)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """On the streams' event loop: queue each output for its stream."""
    for stream, output in items:
        stream._queue.put_nowait(output)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    error: MetraleError


_Add = Submission
_Command = _Add | _Abort | _AbortAll | ControlCall


class AsyncEngine(HandleBase[RequestStream]):
    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self._cond = threading.Condition(self._lock)
        self._inbox: list[_Command] = []
        self._thread: threading.Thread | None = None
        self._stop = False
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
        governor = apply_engine_threads(config, reserve=1)  # one core for the event loop
        return cls(Engine(config, cpu_threads=governor))

    # ----------------------------------------------------------------- lifecycle

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="metrale-engine", daemon=True)
        self._thread.start()

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

    # -------------------------------------------------------------------- intake

    def _enqueue_add(self, submission: Submission) -> None:
        self._submit(submission)

    def _enqueue_control(self, call: ControlCall) -> None:
        self._submit(call)

    def _submit(self, command: _Command) -> None:
        answered = isinstance(command, _Add | ControlCall)
        with self._cond:
            refusal = self._dead or (self._draining if answered else None)
            if refusal is None and self._stop and answered:
                refusal = EngineDeadError("the engine has shut down")
            if refusal is not None:
                if answered:
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
                    self._cond.wait(STALL_WAIT_S)
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
        if isinstance(command, _Add):
            error: BaseException | None = None
            try:
                command.args.apply(self.engine)
            except Exception as exc:  # MetraleError for bad requests; anything else: a bug
                error = exc
            request_id = command.args.request_id
            self._answer_add(request_id, command.stream, command.accepted, command.loop, error)
        elif isinstance(command, ControlCall):
            result, failure = apply_control(self.engine, command.method, command.args)
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                command.loop.call_soon_threadsafe(settle_future, command.done, failure, result)
        elif isinstance(command, _Abort):
            self._abort(command.request_id, None)
        else:
            for request_id in list(self._streams):
                self._abort(request_id, command.error)

    def _abort(self, request_id: str, error: MetraleError | None) -> None:
        output = self.engine.abort_request(request_id)
        with self._lock:
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
        self._route(((o.request_id, o.finished, o) for o in outputs), _put_all)

    # ------------------------------------------------------------- HandleBase hooks

    def _stream_of(self, entry: RequestStream) -> RequestStream:
        return entry

    def _take_unanswered(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        pending, self._inbox = self._inbox, []
        return [
            (c.loop, c.accepted if isinstance(c, _Add) else c.done)
            for c in pending
            if isinstance(c, _Add | ControlCall)
        ]

    def _forget_dead(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # the engine may be broken; the client still gets its error
            logger.debug("abort of %s failed after the loop stopped", request_id)

    def _mark_dead(self) -> None:
        try:
            self._update_snapshot(alive=False)
        except Exception:
            with self._snapshot_lock:
                self._snapshot = EngineSnapshot(alive=False)

    def _update_snapshot(self, alive: bool = True) -> None:
        snap = self._snapshots.take(alive)
        with self._snapshot_lock:
            self._snapshot = snap
