"""Server-sent events, client-disconnect detection, and merging request streams.

Owner: server.

Invariants:
- A streaming response watches the connection while it streams: when the client goes away,
  the body generator is cancelled and closed at once (its `finally` aborts the engine
  requests, freeing their KV), whether it was waiting on the engine or on the socket; its
  `on_close` runs in every case, even if the body never started; `on_disconnect` (before it)
  only when the client left first.
- A non-streaming request whose client disconnects is cancelled the same way
  (`until_disconnected`).
- `merge_streams` yields the outputs of several streams as they come; when it is closed or
  cancelled, every stream not yet finished is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from metrale.engine.async_engine import RequestStream
from metrale.engine.request import RequestOutput

T = TypeVar("T")


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete. `stage` says
    when: "body" (while sending its body), "queue" (before its first token: queued or in
    prefill) or "stream" (after it)."""

    def __init__(self, stage: str = "queue") -> None:
        super().__init__(f"the client disconnected ({stage})")
        self.stage = stage


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` that stops (and closes its generator) as soon as the client leaves."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content: AsyncIterator[str],
        status_code: int = 200,
        on_close: Callable[[], None] | None = None,
        on_disconnect: Callable[[], None] | None = None,
    ) -> None:
        self.on_close = on_close
        self.on_disconnect = on_disconnect
        super().__init__(
            content,
            status_code=status_code,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        left = False
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    nonlocal left
                    try:
                        await self.stream_response(send)
                    except OSError:  # the socket went away mid-send
                        left = True
                    group.cancel_scope.cancel()

                async def watch() -> None:
                    nonlocal left
                    await self.listen_for_disconnect(receive)
                    left = True
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(watch)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if left and self.on_disconnect is not None:
                self.on_disconnect()
            if self.on_close is not None:
                self.on_close()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) pairs in arrival order; errors of any stream are raised."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        finally:
            streams[0].abort()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()
