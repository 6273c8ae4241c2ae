"""The engine handle: what the server holds to reach an `Engine`, whatever runs it.

Owner: engine. `EngineHandle` is the protocol the server codes against; `RequestStream` is one
request's outputs; `HandleBase` is the one implementation of the handle's rules (intake,
delivery, death, drain) that both transports share: `AsyncEngine` (the engine on a thread of
this process) and `EngineProcess` (the engine in a child process). A transport supplies only
how an add, an abort and the outputs travel.

Invariants:
- `add_request` returns once the engine accepted the request, or raises why it did not; a
  caller cancelled while waiting aborts the request (it may have been added meanwhile).
- Every accepted request's stream ends with a finished `RequestOutput` or an exception: a
  handle that dies ends every open stream and every unanswered add with its `EngineDeadError`
  and refuses new requests with it, then calls `on_death` once (after every stream has its
  error); a draining handle refuses new requests only.
- Outputs reach their streams' event loops through `post_by_loop`: one `call_soon_threadsafe`
  per event loop per delivery, never one per request.
- `_streams` (open requests), `_dead` and `_draining` change only under `_lock`.
- A control call (`control`: the LoRA registry's load, unload and list) runs on the engine's
  thread or process between steps and is answered like an add: its result or its error, or
  the handle's `EngineDeadError` when the engine dies first.
- `AddArgs` holds the arguments of `Engine.add_request` the server sets, in the order of the
  process wire's "add" tuple, and hands them to the engine unchanged; its defaults are the
  handle's (`HandleBase.add_request` passes its keywords through it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Generic, Protocol, TypeVar

from metrale.engine.engine import DEFAULT_TENANT
from metrale.engine.request import RequestOutput
from metrale.engine.snapshot import EngineInfo, EngineSnapshot
from metrale.errors import EngineDeadError, MetraleError
from metrale.sampling.params import SamplingParams
from metrale.tokenizer.tokenizer import Tokenizer

T = TypeVar("T")
#: How long a transport's engine loop waits before stepping again when unfinished requests
#: made no progress in a step (e.g. every waiting request is held back); bounds the spin
#: rate of that rare case.
STALL_WAIT_S = 0.005
#: What a transport keeps per open request (the stream itself, or the stream and more).
E = TypeVar("E")


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
        cache_namespace: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        vision: Any = None,
    ) -> RequestStream: ...
    async def control(self, method: str, *args: Any) -> Any: ...


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


def settle_future(
    future: asyncio.Future[Any], error: BaseException | None, result: Any = None
) -> None:
    """Resolve `future` (on its loop's thread) with `error`, else `result`, unless its waiter
    already gave up: an add's acceptance and a control call's answer alike."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def settle_from_thread(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], error: BaseException | None
) -> bool:
    """`settle_future` on `loop`'s thread; False when that loop is closed (nobody waits)."""
    try:
        loop.call_soon_threadsafe(settle_future, future, error)
    except RuntimeError:
        return False
    return True


@dataclass(frozen=True)
class AddArgs:
    """The arguments of `Engine.add_request` the server sets, in the wire's "add" order."""

    request_id: str
    prompt: str | Sequence[int] | None
    params: SamplingParams
    #: The keyword arguments, with `EngineHandle.add_request`'s names and defaults.
    prompt_token_ids: Sequence[int] | None = None
    timeout: float | None = None
    adapter_id: int = 0
    speculative: bool = True
    lookup_tenant: str | None = DEFAULT_TENANT
    cache_namespace: str | None = None
    priority: int = 0
    session_id: str | None = None
    #: The prompt's images (`model_engine.vision.VisionInputs`, numpy arrays: picklable).
    vision: Any = None

    def wire(self) -> tuple[Any, ...]:
        """The process wire's "add" tuple (see `engine_process`)."""
        return ("add", *(getattr(self, f.name) for f in fields(self)))

    @classmethod
    def from_wire(cls, message: tuple[Any, ...]) -> AddArgs:
        return cls(*message[1:])

    def options(self) -> dict[str, Any]:
        """The keyword arguments (every field after `params`), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)[3:]}

    def apply(self, engine: Any) -> None:
        """`engine.add_request` with these arguments (raises what it raises)."""
        engine.add_request(self.request_id, self.prompt, self.params, **self.options())


#: Engine methods the server may run through `control`: the LoRA registry.
CONTROL_METHODS = frozenset({"load_lora_adapter", "unload_lora_adapter", "lora_adapter_list"})


@dataclass
class ControlCall:
    """A call of one of the engine's `CONTROL_METHODS` on its way, and the caller's future."""

    method: str
    args: tuple[Any, ...]
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop

    def wire(self, call_id: int) -> tuple[Any, ...]:
        return ("control", call_id, self.method, self.args)


def apply_control(engine: Any, method: str, args: tuple[Any, ...]) -> tuple[Any, Exception | None]:
    """`engine.<method>(*args)` for a `CONTROL_METHODS` name: (result, None) or (None, error)."""
    if method not in CONTROL_METHODS:
        return None, ValueError(f"{method!r} is not an engine control method")
    try:
        return getattr(engine, method)(*args), None
    except Exception as exc:  # MetraleError for bad input; anything else: a bug, reported
        return None, exc


@dataclass
class Submission:
    """An add on its way to the engine: its arguments, its stream and the caller's future."""

    args: AddArgs
    stream: RequestStream
    accepted: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop


class HandleBase(ABC, Generic[E]):
    """The rules both transports share; a transport implements the abstract hooks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Accepted, unfinished requests (what the transport keeps for each).
        self._streams: dict[str, E] = {}
        self._dead: MetraleError | None = None
        self._draining: MetraleError | None = None
        #: Called once, with the error, when the handle dies (a supervisor's restart hook).
        self.on_death: Callable[[EngineDeadError], None] | None = None

    # ------------------------------------------------------------- transport hooks

    @abstractmethod
    def _stream_of(self, entry: E) -> RequestStream:
        """The stream of an open request's entry."""

    @abstractmethod
    def _enqueue_add(self, submission: Submission) -> None:
        """Send the add to the engine (raises the refusal when no request may be added)."""

    @abstractmethod
    def _take_unanswered(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        """Under `_lock`: remove and return the adds the engine has not answered yet."""

    @abstractmethod
    def _enqueue_control(self, call: ControlCall) -> None:
        """Send a control call to the engine (raises the refusal when the engine is gone)."""

    def _forget_dead(self, request_id: str) -> None:
        """After death: release what the engine may still hold for `request_id`."""

    @abstractmethod
    def _mark_dead(self) -> None:
        """After death: the snapshot says the engine is not alive."""

    @abstractmethod
    def _submit_abort(self, request_id: str) -> None:
        """Tell the engine to abort `request_id` (and stop routing its outputs)."""

    # ----------------------------------------------------------------- lifecycle

    @property
    def dead_error(self) -> MetraleError | None:
        return self._dead

    def begin_drain(self, message: str = "the server is shutting down") -> None:
        """Refuse new requests (503); requests already accepted keep running."""
        with self._lock:
            if self._draining is None:
                self._draining = EngineDeadError(message)

    def num_open_requests(self) -> int:
        return len(self._streams)

    # -------------------------------------------------------------------- intake

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        **options: Any,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it, or raises why it did not.

        `options`: `EngineHandle.add_request`'s keywords (`AddArgs`' fields, where their
        defaults live; an unknown one is a `TypeError` naming it). `speculative` and
        `lookup_tenant` are `Engine.add_request`'s: the per-request opt-out of speculative
        decoding, and the cross-request draft lookup's partition."""
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, loop)
        accepted: asyncio.Future[None] = loop.create_future()
        add = AddArgs(request_id, prompt, params, **options)
        self._enqueue_add(Submission(add, stream, accepted, loop))
        try:
            await accepted
        except asyncio.CancelledError:
            self._submit_abort(request_id)  # it may have been added meanwhile
            raise
        return stream

    async def control(self, method: str, *args: Any) -> Any:
        """Run `engine.<method>(*args)` (one of `CONTROL_METHODS`) between engine steps;
        returns its result or raises its error."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._enqueue_control(ControlCall(method, tuple(args), done, loop))
        return await done

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

    def _answer_add(
        self,
        request_id: str,
        entry: E,
        accepted: asyncio.Future[None],
        loop: asyncio.AbstractEventLoop,
        error: BaseException | None,
    ) -> None:
        """The engine answered an add: open the stream if accepted, wake the caller."""
        if error is None:
            with self._lock:
                self._streams[request_id] = entry
        if not settle_from_thread(loop, accepted, error) and error is None:
            self._submit_abort(request_id)  # the caller's loop is gone: nobody reads this

    # ------------------------------------------------------------------ delivery

    def _route(
        self,
        updates: Iterable[tuple[str, bool, T]],
        put: Callable[[list[tuple[E, T]]], None],
    ) -> None:
        """Post each `(request_id, finished, update)` to its open request's event loop,
        `put` applying them there; a finished request's entry is closed."""
        items = []
        with self._lock:
            streams = self._streams
            for request_id, finished, update in updates:
                entry = streams.pop(request_id, None) if finished else streams.get(request_id)
                if entry is not None:
                    items.append((self._stream_of(entry)._loop, (entry, update)))
        post_by_loop(items, put)

    def _die(self, error: EngineDeadError) -> None:
        """The engine is gone: fail every open stream and unanswered add, refuse new ones."""
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = error
            entries = list(self._streams.items())
            self._streams.clear()
            unanswered = self._take_unanswered()
        # Before anyone hears of the death: a caller woken by the error below must already
        # read a dead snapshot.
        self._mark_dead()
        for loop, accepted in unanswered:
            settle_from_thread(loop, accepted, copy.copy(error))
        for request_id, entry in entries:
            self._forget_dead(request_id)
            self._stream_of(entry)._post(copy.copy(error))
        if first and self.on_death is not None:
            self.on_death(error)
