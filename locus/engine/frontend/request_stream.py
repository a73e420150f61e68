"""One admitted request's outputs on the caller's side of AsyncEngine: the sink the engine thread fills
(through call_soon_threadsafe) and the stream its one reader iterates or listens to."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from locus.engine.core.outputs import RequestOutput, merge_outputs

if TYPE_CHECKING:
    from locus.engine.frontend.async_engine import AsyncEngine


class RequestStream:
    """An admitted request's outputs, read on the event loop that added it. Leaving it before the
    last output (`aclose`, or the `async with` block) aborts the request."""

    def __init__(self, engine: "AsyncEngine", request_id: str, sink: "OutputSink"):
        self.engine, self.request_id, self._sink = engine, request_id, sink
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._sink.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            await self.aclose(abort=False)
            raise item
        if item.finished:
            await self.aclose(abort=False)
        return item

    def listen(self, listener: Callable[[object], bool] | None) -> None:
        """Have `listener` called, on this event loop, with each output or error as the engine
        delivers it (outputs that waited, merged, first) instead of iterating. It returns False when
        it cannot take one now; call `drain` when it can. The listener must not raise."""
        self._sink.listen(listener)

    def drain(self) -> None:
        self._sink.drain()

    async def aclose(self, abort: bool = True) -> None:
        if self._done:
            return
        self._done = True
        self._sink.listen(None)
        self.engine.close_stream(self.request_id, abort)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class OutputSink:
    """One request's outputs, from the engine thread (through call_soon_threadsafe) to its single
    reader on the event loop. Lighter than asyncio.Queue, which the loop would pay for per token
    per stream, on the cores the forward needs; outputs waiting when the reader comes back are
    merged into one, so a lagging stream catches up with one frame.

    A reader may instead listen: its callback gets each output as it is put, on the event loop, with
    no task to wake (the server writes a stream's frames from there). A callback that cannot take an
    output now returns False; the output then waits, merged with later ones, until `drain`."""

    __slots__ = ("_items", "_waiter", "final_only", "_listener")

    def __init__(self, final_only: bool = False):
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        # its reader wants only the finished output: the engine thread hands it nothing else (_deliver_step)
        self.final_only = final_only
        self._listener: Callable[[object], bool] | None = None

    def put(self, item) -> None:  # on the event loop
        if self._listener is not None and not self._items and self._listener(item):
            return
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self):
        """The next error, or every output waiting, merged into one."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self):
        items = self._items
        first = items[0]
        if len(items) == 1 or isinstance(first, BaseException):
            del items[0]
            return first
        count = 1
        while count < len(items) and not isinstance(items[count], BaseException):
            first = merge_outputs(first, items[count])
            count += 1
        del items[:count]  # an error after the outputs stays for the next get()
        return first

    def listen(self, listener: Callable[[object], bool] | None) -> None:
        """Hand every output to `listener` as it is put (None: back to get()); what waits now goes first."""
        self._listener = listener
        if listener is not None:
            self.drain()

    def drain(self) -> None:
        """Offer what waits to the listener (merged, as get() would) until it declines or nothing is left."""
        while self._items and self._listener is not None:
            item = self._take()
            if not self._listener(item):
                self._items.insert(0, item)
                return


def put_all(items: list[tuple[OutputSink, RequestOutput]]) -> None:
    for sink, out in items:
        sink.put(out)
