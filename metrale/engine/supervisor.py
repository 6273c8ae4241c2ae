"""`SupervisedEngine`: an engine handle that restarts its engine when it dies.

Owner: engine. The server holds one (`metrale serve`, `--restart-engine-on-failure`, on by
default) around the handle a factory builds (`EngineProcess`, or `AsyncEngine` in-process).
When that handle dies (the engine process was killed or exited, or the loop crashed), every
in-flight request has already received the handle's `EngineDeadError` (`HandleBase._die`);
the supervisor then builds a fresh handle on a thread of its own, retrying with backoff, and
serves new requests with it once it is ready. `restarts` counts the restarts that succeeded
(`metrale_engine_restarts_total`).

Invariants:
- While the engine is dead or restarting, `dead_error` is an `EngineDeadError` (503, so
  `/health` and new requests say so at once, with `Retry-After`); once a new handle is up it is
  None again. No request waits for a restart.
- A handle that dies after `begin_drain` or `shutdown` is never restarted; `shutdown` stops a
  restart in progress and the handle it may have produced.
- Streams stay bound to the handle that accepted them (their aborts go there); only new adds
  reach the new handle. `info` and `tokenizer` are the first handle's (same configuration).
- Without restarts (`restart=False`) the supervisor is a plain pass-through of one handle.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from metrale.engine.handle import EngineHandle, RequestStream
from metrale.engine.snapshot import EngineSnapshot
from metrale.errors import EngineDeadError, MetraleError
from metrale.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

#: First wait before retrying a restart that failed; doubles up to `_MAX_BACKOFF_S`.
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0


class SupervisedEngine:
    """An `EngineHandle` over the handles `factory` builds, restarting a dead one."""

    def __init__(
        self,
        factory: Callable[[], EngineHandle],
        *,
        restart: bool = True,
        first: EngineHandle | None = None,
    ) -> None:
        self._factory = factory
        self.restart = restart
        self._lock = threading.Lock()
        self._current: EngineHandle = first if first is not None else factory()
        self.info = self._current.info
        self.tokenizer = self._current.tokenizer
        #: Restarts that produced a running engine.
        self.restarts = 0
        self._started = False
        self._stopping = False
        self._draining: str | None = None
        #: Set while the engine is dead and a restart runs (what `dead_error` reports).
        self._outage: EngineDeadError | None = None
        self._restarter: threading.Thread | None = None
        self._watch(self._current)

    # ----------------------------------------------------------------- handle

    @property
    def current(self) -> EngineHandle:
        """The handle new requests go to."""
        return self._current

    @property
    def is_running(self) -> bool:
        return self._outage is None and self._current.is_running

    @property
    def dead_error(self) -> MetraleError | None:
        return self._outage or self._current.dead_error

    def start(self) -> None:
        with self._lock:
            self._started = True
            current = self._current
        current.start()

    def begin_drain(self, message: str = "the server is shutting down") -> None:
        with self._lock:
            self._draining = message
            current = self._current
        current.begin_drain(message)

    def abort_all(self, message: str) -> None:
        self._current.abort_all(message)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            current, restarter = self._current, self._restarter
        current.shutdown(timeout)
        if restarter is not None and restarter is not threading.current_thread():
            restarter.join(timeout)
            with self._lock:
                late = self._current
            if late is not current:
                late.shutdown(timeout)

    def snapshot(self) -> EngineSnapshot:
        return self._current.snapshot()

    def num_open_requests(self) -> int:
        return self._current.num_open_requests()

    def _submit_abort(self, request_id: str) -> None:
        self._current._submit_abort(request_id)

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | None,
        params: SamplingParams,
        **options: Any,
    ) -> RequestStream:
        """The current engine's `add_request` (`EngineHandle`'s keywords pass through), or
        the outage's error while the engine restarts."""
        outage = self._outage
        if outage is not None:
            raise copy.copy(outage)
        return await self._current.add_request(request_id, prompt, params, **options)

    async def control(self, method: str, *args: Any) -> Any:
        """The current engine's `control`, or the outage's error while it restarts."""
        outage = self._outage
        if outage is not None:
            raise copy.copy(outage)
        return await self._current.control(method, *args)

    # ---------------------------------------------------------------- restarts

    def _watch(self, handle: EngineHandle) -> None:
        if hasattr(handle, "on_death"):
            handle.on_death = lambda error: self._on_death(handle, error)  # type: ignore[attr-defined]

    def _on_death(self, handle: EngineHandle, error: EngineDeadError) -> None:
        """A handle died (called on its reader / engine thread, after its streams failed)."""
        with self._lock:
            if handle is not self._current or self._stopping or self._draining is not None:
                return
            if not self.restart:
                return
            self._outage = EngineDeadError(f"{error.message}; the engine is restarting")
            self._restarter = threading.Thread(
                target=self._restart, args=(handle, error), name="metrale-engine-restart",
                daemon=True,
            )  # fmt: skip
            restarter = self._restarter
        logger.error("the engine died (%s); restarting it", error.message)
        restarter.start()

    def _restart(self, dead: EngineHandle, error: EngineDeadError) -> None:
        try:
            dead.shutdown(5.0)  # reap the process, close the pipe
        except Exception:  # it is dead already; nothing more to release
            logger.debug("shutdown of the dead engine failed", exc_info=True)
        backoff = _FIRST_BACKOFF_S
        while True:
            with self._lock:
                if self._stopping:
                    return
            started = time.monotonic()
            try:
                fresh = self._factory()
            except Exception as exc:
                logger.error("engine restart failed (%s: %s); retrying in %.0f s",
                             type(exc).__name__, exc, backoff)  # fmt: skip
                time.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            break
        with self._lock:
            stopping = self._stopping
            if not stopping:
                self._current = fresh
                self._watch(fresh)
                if self._draining is not None:
                    fresh.begin_drain(self._draining)
        if stopping:
            fresh.shutdown(5.0)
            return
        if self._started:
            fresh.start()
        with self._lock:
            self.restarts += 1
            self._outage = None
        logger.warning(
            "the engine restarted in %.1f s (restart %d)", time.monotonic() - started, self.restarts
        )

    def __getattr__(self, name: str) -> Any:
        # Anything else a caller reads of the handle (e.g. `pid`, `engine`): the current one's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._current, name)
