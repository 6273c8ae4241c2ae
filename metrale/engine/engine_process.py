"""`EngineProcess`: the `Engine` in a child process, behind the same asyncio interface as
`AsyncEngine`, so the server's Python never competes with the engine loop for one GIL.

Owner: engine. The process transport of the engine handle (`metrale.engine.handle`): the rules
of intake, delivery and death live in `HandleBase`; this module adds the child and the pipe (the
output deltas it carries are `output_delta.py`'s). The parent (the server) holds an `EngineProcess`: `add_request` returns a
`RequestStream`, `snapshot` gives the metrics' gauges, `begin_drain` / `abort_all` /
`shutdown` serve a graceful exit, `info` and `tokenizer` describe the model. The child runs
`_child_main`: it loads the model, then loops over commands and steps.

Why a process: in one process the HTTP layer's per-token work (one SSE event per stream per
step) and the engine thread share the GIL, and every torch call of the engine thread (each
releases the GIL) can wait a whole switch interval to get it back; at 128 streams that made
decode host-bound (vLLM's API server + EngineCore and SGLang's tokenizer / scheduler processes
split the same way).

Wire protocol (pickled tuples over one duplex `multiprocessing` pipe):
- parent -> child: ("add", request_id, prompt, params, prompt_token_ids, timeout, adapter_id,
  speculative, lookup_tenant, cache_namespace, priority, session_id, vision) (the arguments of `Engine.add_request`, in that order),
  ("abort", request_id), ("control", call_id, method, args) (`handle.CONTROL_METHODS`: the
  LoRA registry), ("shutdown",).
- child -> parent: ("ready", EngineInfo) or ("failed", error) once at startup; then
  ("added", request_id, error | None) answering each add, ("controlled", call_id, result,
  error | None) answering each control call, ("out", [OutputDelta as a plain tuple], snapshot |
  None) once per step, ("snapshot", snapshot) when the engine goes idle, ("dead", message)
  if the loop crashes. A snapshot is an `EngineSnapshot` (speculation counters included).

Invariants:
- "out" messages carry every request's new tokens as deltas (new text, new token ids, new
  logprobs), so the bytes sent per step grow with the batch, not with the length of the
  outputs; a step's outputs are sent while the next forward runs (`Engine.step`'s
  `on_outputs`), at most two messages per step; the parent rebuilds the cumulative `RequestOutput`s the routes read,
  as fresh objects (an output handed to a consumer never changes afterwards).
- Every add is answered (accepted or its error), and every accepted request's stream ends with
  a finished output or an exception: a child that dies, crashes or stops ends every open
  stream with `EngineDeadError` and refuses new requests.
- `child_env` (a data-parallel replica's `CUDA_VISIBLE_DEVICES` / `OMP_NUM_THREADS`), with
  the OpenMP spin count of a governed CPU engine (`cpu_threads.engine_process_env`), reaches
  the child only: this process's environment holds it, under a lock, just while the child
  starts (a spawned child copies the environment then), and is restored right after.
- Threads (`engine.cpu_threads`): the child runs the engine's CPU policy, leaving one core to
  the parent (`--cpu-threads` overrides); the parent, which runs no model, takes one torch
  thread once the child is started.
- The child ignores SIGINT/SIGTERM (the parent drains and stops it) and exits when the pipe
  closes, so it never outlives the server.
- Outputs are applied on the streams' event loop, one `call_soon_threadsafe` per step.
- Commands are sent from the event loop; the child reads them between steps, so an add whose
  pickled prompt exceeds the pipe's buffer holds the loop for at most one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
import multiprocessing
import os
import pickle
import select
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from metrale.config import EngineConfig
from metrale.engine.cpu_threads import (
    apply_engine_threads,
    apply_frontend_threads,
    engine_process_env,
)
from metrale.engine.handle import (
    STALL_WAIT_S,
    AddArgs,
    ControlCall,
    HandleBase,
    RequestStream,
    Submission,
    apply_control,
    settle_future,
)
from metrale.engine.output_delta import Assembly, DeltaEncoder, OutputDelta, apply_delta
from metrale.engine.snapshot import EngineInfo, EngineSnapshot, SnapshotTaker, engine_info
from metrale.errors import EngineDeadError, MetraleError
from metrale.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

#: Least time between two snapshots sent while the engine is busy.
_SNAPSHOT_INTERVAL_S = 0.1
#: How long `shutdown` waits for the child to exit before terminating it.
_EXIT_WAIT_S = 10.0
#: Cores the engine's CPU thread policy leaves to the HTTP process (`cpu_threads`).
_RESERVE = 1


# ----------------------------------------------------------------------------- child


def _child_main(config: EngineConfig, conn: Connection, log_level: int) -> None:
    """The engine process: load, say ready (or why not), then serve commands and step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"
    )
    from metrale.engine.engine import Engine

    try:
        governor = apply_engine_threads(config, reserve=_RESERVE)
        engine = Engine(config, cpu_threads=governor)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send(("failed", _portable(exc)))
        return
    conn.send(("ready", engine_info(engine)))
    # The loaded model's objects live as long as the process: keep the collector from walking
    # them again and again (each step allocates many short-lived objects, which triggers it).
    gc.collect()
    gc.freeze()
    try:
        _ChildLoop(engine, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent went away: nothing left to serve
    except BaseException as exc:
        logging.getLogger(__name__).exception("the engine loop crashed")
        with contextlib.suppress(Exception):
            conn.send(("dead", f"the engine loop stopped: {type(exc).__name__}: {exc}"))


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles, else an `EngineDeadError` with its text."""
    try:
        pickle.dumps(exc)
    except Exception:
        return EngineDeadError(f"{type(exc).__name__}: {exc}")
    return exc


class _ChildLoop:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        #: Whether a command (or the pipe's end) is waiting: one poll object for the loop's
        #: life (`run` registers the pipe), where `Connection.poll` builds, registers and
        #: closes a selector every call (once per step: ~2% of a tiny model's served step,
        #: issue 26).
        self._commands = select.poll()
        self.encoder = DeltaEncoder()
        self.snapshots = SnapshotTaker(engine)
        self.snapshot_sent_at = float("-inf")
        #: Outputs sent so far (progress, for the stall check).
        self.sent = 0

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        self._commands.register(conn.fileno(), select.POLLIN)
        stalled = False
        while True:
            if not engine.has_unfinished():
                self._command_waiting(None)  # idle: sleep until a command arrives
            elif stalled:
                self._command_waiting(STALL_WAIT_S)
            while self._command_waiting(0):
                if not self._apply(conn.recv()):
                    return
            stalled = False
            if engine.has_unfinished():
                steps_before, sent_before = engine.num_steps, self.sent
                # Outputs built during the forward go out during the forward.
                outputs = engine.step_as(self.encoder.encode_state, on_outputs=self._send)
                idle = not engine.has_unfinished()
                snapshot = self._snapshot_if_due(force=idle)
                if outputs or snapshot is not None:
                    self._send(outputs, snapshot)
                stalled = self.sent == sent_before and engine.num_steps == steps_before

    def _command_waiting(self, timeout: float | None) -> bool:
        """Whether the parent's pipe can be read (a command, or its end: `recv` then raises
        `EOFError`), waiting up to `timeout` seconds (None: until it can)."""
        return bool(self._commands.poll(None if timeout is None else 1000 * timeout))

    def _send(self, deltas: list[tuple[Any, ...]], snapshot: EngineSnapshot | None = None) -> None:
        """One "out" message: the step's wire deltas (`DeltaEncoder.encode_state`), pickled
        by `pickle` itself (what `Connection.send` does through a fresh `ForkingPickler`,
        whose reducers a message of plain values and snapshots never needs; the parent's
        `recv` reads either)."""
        self.sent += len(deltas)
        self.conn.send_bytes(pickle.dumps(("out", deltas, snapshot), pickle.HIGHEST_PROTOCOL))

    def _snapshot_if_due(self, force: bool) -> EngineSnapshot | None:
        now = time.monotonic()
        if not force and now - self.snapshot_sent_at < _SNAPSHOT_INTERVAL_S:
            return None
        self.snapshot_sent_at = now
        return self.snapshots.take()

    def _apply(self, command: tuple[Any, ...]) -> bool:
        """Apply one command; False when it says to stop."""
        kind = command[0]
        if kind == "add":
            add = AddArgs.from_wire(command)
            error: BaseException | None = None
            try:
                add.apply(self.engine)
            except Exception as exc:  # MetraleError for bad requests; anything else: a bug
                error = _portable(exc)
            self.conn.send(("added", add.request_id, error))
        elif kind == "abort":
            self.engine.abort_request(command[1])
            self.encoder.forget(command[1])
            if not self.engine.has_unfinished():
                self.conn.send(("snapshot", self._snapshot_if_due(force=True)))
        elif kind == "control":
            _, call_id, method, args = command
            result, failure = apply_control(self.engine, method, args)
            self.conn.send(
                ("controlled", call_id, result, None if failure is None else _portable(failure))
            )
        elif kind == "shutdown":
            return False
        else:
            raise ValueError(f"unknown engine command {kind!r}")
        return True


# ---------------------------------------------------------------------------- parent

#: Serialises the environment swap around a child's start (a spawned child copies this
#: process's environment when it starts, and only then).
_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _child_environ(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set `env` in this process's environment while a child starts, then restore it."""
    if not env:
        yield
        return
    with _ENV_LOCK:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@dataclass
class _PendingAdd:
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
    assembly: Assembly


class EngineProcess(HandleBase[Assembly]):
    """The parent's handle on the engine process: the process transport of `HandleBase`."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        start_timeout: float | None = None,
        child_env: Mapping[str, str] | None = None,
    ) -> None:
        """Start the child and wait until its model is loaded (raises why it could not).
        `child_env`: variables set in the child's environment only (a data-parallel
        replica's `CUDA_VISIBLE_DEVICES`, `metrale.engine.replicas`)."""
        super().__init__()  # _lock guards _streams, _pending, _dead, _draining
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=True)
        self._process = context.Process(
            target=_child_main,
            args=(config, child_conn, logging.getLogger("metrale").getEffectiveLevel()),
            name="metrale-engine",
            daemon=True,
        )
        spin = engine_process_env(config, _RESERVE, child_env)  # how its OpenMP workers wait
        with _child_environ({**spin, **(child_env or {})}):
            self._process.start()
        child_conn.close()
        apply_frontend_threads()
        self._send_lock = threading.Lock()
        #: Adds the child has not answered yet.
        self._pending: dict[str, _PendingAdd] = {}
        #: Control calls the child has not answered yet, by call id.
        self._controls: dict[int, ControlCall] = {}
        self._next_call = 0
        self._snapshot = EngineSnapshot()
        self._reader: threading.Thread | None = None
        if not self._conn.poll(start_timeout):
            self._process.terminate()
            raise EngineDeadError("the engine process did not start in time")
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join(5)
            raise EngineDeadError(
                f"the engine process exited while loading (exit code {self._process.exitcode})"
            ) from None
        if message[0] == "failed":
            self._process.join(5)
            raise message[1]
        self.info: EngineInfo = message[1]
        self.tokenizer = Tokenizer.from_dir(
            config.tokenizer or self.info.model_dir, chat_template=config.chat_template
        )

    # ----------------------------------------------------------------- lifecycle

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        """The engine process's id (what a supervisor or a fault test watches)."""
        return self._process.pid

    def start(self) -> None:
        if self._reader is not None:
            return
        self._reader = threading.Thread(
            target=self._read, name="metrale-engine-reader", daemon=True
        )
        self._reader.start()

    def abort_all(self, message: str) -> None:
        with self._lock:
            streams = list(self._streams.items())
            self._streams.clear()
        for request_id, assembly in streams:
            self._send(("abort", request_id))
            assembly.stream._post(EngineDeadError(message))

    def shutdown(self, timeout: float = _EXIT_WAIT_S) -> None:
        self.begin_drain()
        self._send(("shutdown",))
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not exit in %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(5)
        self._die(EngineDeadError("the engine has shut down"))
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        self._conn.close()

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # -------------------------------------------------------------------- intake

    def _enqueue_add(self, submission: Submission) -> None:
        """Register the add and send it as one "add" tuple (token ids as a list)."""
        add, stream = submission.args, submission.stream
        prompt, request_id = add.prompt, add.request_id
        text = prompt if isinstance(prompt, str) else None
        ids = list(add.prompt_token_ids) if add.prompt_token_ids is not None else None
        if ids is None and prompt is not None and not isinstance(prompt, str):
            ids = list(prompt)
        assembly = Assembly(stream, text, ids or [])
        with self._lock:
            refusal = self._dead or self._draining
            if refusal is None and request_id in self._pending:
                refusal = MetraleError(f"request id {request_id!r} is already in use")
            if refusal is None:
                self._pending[request_id] = _PendingAdd(
                    submission.accepted, submission.loop, assembly
                )
        if refusal is not None:
            raise copy.copy(refusal)
        self._send(replace(add, prompt_token_ids=ids).wire())

    def _enqueue_control(self, call: ControlCall) -> None:
        with self._lock:
            refusal = self._dead or self._draining
            if refusal is None:
                self._next_call += 1
                call_id = self._next_call
                self._controls[call_id] = call
        if refusal is not None:
            raise copy.copy(refusal)
        self._send(call.wire(call_id))

    def _submit_abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self._send(("abort", request_id))

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the pipe is closed: the child is gone
            self._die(EngineDeadError("the engine process is gone"))

    # --------------------------------------------------------------- reader thread

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "out":
                    _, deltas, snap = message
                    if snap is not None:
                        self._snapshot = snap
                    self._route(((d[0], d[1], d) for d in deltas), _put_deltas)
                elif kind == "added":
                    self._settle(message[1], message[2])
                elif kind == "controlled":
                    _, call_id, result, failure = message
                    with self._lock:
                        call = self._controls.pop(call_id, None)
                    if call is not None:
                        with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                            call.loop.call_soon_threadsafe(
                                settle_future, call.done, failure, result
                            )
                elif kind == "snapshot":
                    self._snapshot = message[1]
                elif kind == "dead":
                    self._die(EngineDeadError(message[1]))
                    return
        except (EOFError, OSError):
            code = self._process.exitcode
            self._die(EngineDeadError(f"the engine process exited (code {code})"))

    def _settle(self, request_id: str, error: BaseException | None) -> None:
        with self._lock:
            pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._answer_add(request_id, pending.assembly, pending.future, pending.loop, error)

    # ------------------------------------------------------------- HandleBase hooks

    def _stream_of(self, entry: Assembly) -> RequestStream:
        return entry.stream

    def _take_unanswered(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        pending = [(p.loop, p.future) for p in self._pending.values()]
        pending += [(c.loop, c.done) for c in self._controls.values()]
        self._pending.clear()
        self._controls.clear()
        return pending

    def _mark_dead(self) -> None:
        self._snapshot = replace(self._snapshot, alive=False)


def _put_deltas(items: list[tuple[Assembly, tuple[Any, ...]]]) -> None:
    """On the streams' event loop: rebuild each cumulative output from its wire delta and
    queue it."""
    for assembly, delta in items:
        assembly.stream._queue.put_nowait(apply_delta(assembly, OutputDelta.of(delta)))
