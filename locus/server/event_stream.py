"""The streamed response: SSE text in blocks, one body write per block.

Why not Starlette's StreamingResponse: the event loop shares the 2 cores (and the GIL) with the
forward pass, and every write to a loopback socket costs about as much CPU as all the Python a token
takes. A streamed request here writes once per engine output (however many SSE frames the output
makes), and its end (the last token's chunk, the usage chunk, `[DONE]` and the end of the chunked
body) in one write instead of four. The bytes on the wire are those of one frame per write, so
clients see the same stream.

A client that goes away is noticed by a watcher waiting on the server's `http.disconnect` (no
polling): it cancels the writer, which closes the block iterator, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:
    from locus.engine.frontend.async_engine import RequestStream

# A block of SSE text, and whether it is the last of the body.
Block = tuple[str, bool]

# The scope key under which LocusAPI keeps the server's own `send` (see body_send).
SERVER_SEND = "locus.server_send"


def body_send(scope: Scope, send: Send) -> Send:
    """Where a stream writes its body chunks: the server's own `send`, past the send wrappers of
    Starlette's and FastAPI's middleware (server errors, exception handlers, body limit), which
    each look only at `http.response.start` and pass every body message through. That start
    message still goes through them. Each wrapper is a coroutine per call, and the body is written
    once per token per stream, on the event loop that shares the cores with the forward pass. An
    app that adds a middleware which rewrites bodies (gzip, say) must not use this."""
    return scope.get(SERVER_SEND, send)


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, blocks: AsyncIterator[Block], headers: Mapping[str, str] | None = None):
        self.blocks = blocks
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        writer = asyncio.current_task()
        state = {"ending": False, "gone": False}

        async def watch() -> None:
            # After the last write the server answers receive() with http.disconnect too: `ending`
            # tells the two apart.
            await wait_for_disconnect(receive)
            if not state["ending"]:
                state["gone"] = True
                writer.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            async for text, last in self.blocks:
                state["ending"] = last
                await send({"type": "http.response.body", "body": text.encode(), "more_body": not last})
                if last:
                    return
            state["ending"] = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            writer.uncancel()  # our own cancellation: the client left, the response is over
        finally:
            watcher.cancel()
            await self.blocks.aclose()


class ListenedEventStream(Response):
    """One request's stream, written from the event loop's per-step delivery: the engine's outputs
    reach `render` and the socket in the callback that hands them over, with no task woken, no
    generator resumed and no queue between them per token per stream.

    A write that has to wait (the client reads slower than the engine writes) is finished in a task;
    meanwhile the outputs wait in the request's sink and go out merged in one frame after it.
    """

    media_type = "text/event-stream"

    def __init__(self, stream: "RequestStream", render: Callable[[object], Block], error_frame: Callable[[BaseException], str],
                 start: str = "", headers: Mapping[str, str] | None = None):
        self.stream, self.render, self.error_frame, self.start = stream, render, error_frame, start
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if self.start:
            await send({"type": "http.response.body", "body": self.start.encode(), "more_body": True})
        loop = asyncio.get_running_loop()
        writer = _Writer(body_send(scope, send), self.render, self.error_frame, loop.create_future(), self.stream)
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            self.stream.listen(writer.take)
            await asyncio.wait({writer.done, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done.done():
                writer.done.result()  # a failed write raises here
        finally:
            watcher.cancel()
            if writer.pending is not None:
                writer.pending.cancel()
            if not writer.done.done():
                writer.done.cancel()
            # the client left (or the server stops) before the end: the request is aborted
            await self.stream.aclose(abort=not writer.ended)


class _Writer:
    """The listener of ListenedEventStream: render an output, write it, end the body on the last."""

    __slots__ = ("send", "render", "error_frame", "done", "stream", "pending", "ended")

    def __init__(self, send: Send, render, error_frame, done: asyncio.Future, stream):
        self.send, self.render, self.error_frame, self.done, self.stream = send, render, error_frame, done, stream
        self.pending: asyncio.Task | None = None  # a write waiting for the transport
        self.ended = False  # the body's last block was handed to the server

    def take(self, item) -> bool:
        """Called by the sink on the event loop; False while a write waits (the item waits too)."""
        if self.pending is not None or self.ended:
            return self.ended  # after the end nothing more is written (a late abort output)
        try:
            if isinstance(item, BaseException):
                text, last = self.error_frame(item), True
            else:
                try:
                    text, last = self.render(item)
                except Exception as exc:  # noqa: BLE001 - sent to the client as an SSE error frame
                    text, last = self.error_frame(exc), True
            if not text and not last:
                return True
            self.ended = last
            self.write(text.encode(), last)
        except BaseException as exc:  # noqa: BLE001 - the sink's caller delivers to other streams too
            if not self.done.done():
                self.done.set_exception(exc)
        return True

    def write(self, body: bytes, last: bool) -> None:
        coro = self.send({"type": "http.response.body", "body": body, "more_body": not last})
        try:
            waiting_on = coro.send(None)
        except StopIteration:  # written (the usual case: the transport took it)
            if last and not self.done.done():
                self.done.set_result(None)
            return
        self.pending = asyncio.ensure_future(self._finish(coro, waiting_on, last))

    async def _finish(self, coro, waiting_on, last: bool) -> None:
        try:
            await _resume(coro, waiting_on)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - ends the response
            if not self.done.done():
                self.done.set_exception(exc)
            return
        self.pending = None
        if last:
            if not self.done.done():
                self.done.set_result(None)
            return
        self.stream.drain()  # what the engine delivered meanwhile, merged into one frame


class _Suspension:
    """Yields, once, what a coroutine driven by hand yielded (the future it waits on), so the task
    awaiting this waits on it exactly as if it had run that coroutine itself."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __await__(self):
        yield self.value


async def _resume(coro, waiting_on) -> None:
    """Finish, in the current task, a coroutine that was started by hand and is suspended on
    `waiting_on` (what asyncio's Task does with every coroutine)."""
    while True:
        try:
            await _Suspension(waiting_on)
        except BaseException as exc:  # this task was cancelled: so is the coroutine
            try:
                waiting_on = coro.throw(exc)
            except StopIteration:
                return
            continue
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client is gone: the server's next message after the request body is
    http.disconnect (uvicorn sends it when the connection drops, or once the response is complete)."""
    while (await receive())["type"] != "http.disconnect":
        pass
