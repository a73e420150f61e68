"""ListenedEventStream: outputs written from the sink's callback, a write that must wait (the client
reads slowly) finished in a task while later outputs wait and go out merged, and a client that
leaves aborting the request. Driven at the ASGI level with a real sink and a `send` that can stall."""

from __future__ import annotations

import asyncio

from fastapi import Request

from locus.engine.frontend.request_stream import OutputSink
from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.server.event_stream import ListenedEventStream


def output(text: str, finished: bool = False) -> RequestOutput:
    choice = CompletionOutput(0, "", [], text, [1], finish_reason="length" if finished else None)
    return RequestOutput("r", [1], [choice], finished, metrics=None)


class Stream:
    """What ListenedEventStream uses of a RequestStream, over a real sink."""

    def __init__(self):
        self.sink = OutputSink()
        self.closed_with_abort: bool | None = None

    def listen(self, listener):
        self.sink.listen(listener)

    def drain(self):
        self.sink.drain()

    async def aclose(self, abort: bool = True):
        self.closed_with_abort = abort
        self.sink.listen(None)


def render(out: RequestOutput):
    text = f"data: {out.outputs[0].delta_text}\n\n"
    return (text + "data: [DONE]\n\n", True) if out.finished else (text, False)


class Transport:
    """`send` of a server whose transport is paused while `stalled` is set."""

    def __init__(self):
        self.bodies: list[tuple[bytes, bool]] = []
        self.stalled: asyncio.Event | None = None

    async def send(self, message):
        if message["type"] == "http.response.body" and self.stalled is not None:
            await self.stalled.wait()
        if message["type"] == "http.response.body":
            self.bodies.append((message["body"], message["more_body"]))

    def release(self) -> None:
        """Unpause: the write waiting finishes, later ones go through at once."""
        stalled, self.stalled = self.stalled, None
        stalled.set()


async def never_disconnects():
    await asyncio.Event().wait()


async def respond(stream: Stream, transport: Transport, receive=never_disconnects, start: str = "") -> asyncio.Task:
    """The response running in its own task, as the server runs it."""
    response = ListenedEventStream(stream, render, lambda exc: f"data: error {exc}\n\n", start=start)
    task = asyncio.create_task(response({"type": "http"}, receive, transport.send))
    await asyncio.sleep(0)
    return task


def test_outputs_are_written_from_the_callback_and_merged_behind_a_stalled_write():
    async def main():
        stream, transport = Stream(), Transport()
        task = await respond(stream, transport)
        stream.sink.put(output("a"))  # written at once, inside put
        assert transport.bodies == [(b"data: a\n\n", True)]
        transport.stalled = asyncio.Event()
        stream.sink.put(output("b"))  # this write waits for the transport
        stream.sink.put(output("c"))
        stream.sink.put(output("d"))  # these two wait in the sink
        await asyncio.sleep(0)
        assert len(transport.bodies) == 1
        transport.release()
        await asyncio.sleep(0.01)
        assert transport.bodies[1:] == [(b"data: b\n\n", True), (b"data: cd\n\n", True)]  # c and d merged
        stream.sink.put(output("e", finished=True))
        await asyncio.wait_for(task, 1)
        assert transport.bodies[-1] == (b"data: e\n\ndata: [DONE]\n\n", False)
        assert stream.closed_with_abort is False

    asyncio.run(main())


def test_the_end_waiting_behind_a_stalled_write_still_ends_the_body():
    async def main():
        stream, transport = Stream(), Transport()
        task = await respond(stream, transport)
        transport.stalled = asyncio.Event()
        stream.sink.put(output("x"))
        stream.sink.put(output("y", finished=True))
        transport.release()
        await asyncio.wait_for(task, 1)
        assert transport.bodies == [(b"data: x\n\n", True), (b"data: y\n\ndata: [DONE]\n\n", False)]
        assert stream.closed_with_abort is False

    asyncio.run(main())


def test_an_error_ends_the_body_with_an_error_frame():
    async def main():
        stream, transport = Stream(), Transport()
        task = await respond(stream, transport)
        stream.sink.put(output("a"))
        stream.sink.put(RuntimeError("boom"))
        await asyncio.wait_for(task, 1)
        assert transport.bodies == [(b"data: a\n\n", True), (b"data: error boom\n\n", False)]

    asyncio.run(main())


def test_outputs_before_the_response_starts_go_out_first_and_a_client_that_leaves_aborts():
    async def main():
        stream, transport = Stream(), Transport()
        stream.sink.put(output("early"))
        stream.sink.put(output("er"))
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        task = await respond(stream, transport, receive, start="data: start\n\n")
        await asyncio.sleep(0.01)
        assert transport.bodies == [(b"data: start\n\n", True), (b"data: earlyer\n\n", True)]
        gone.set()
        await asyncio.wait_for(task, 1)
        assert stream.closed_with_abort is True
        stream.sink.put(output("late"))  # nobody listens any more: it waits in the sink, unwritten
        assert len(transport.bodies) == 2

    asyncio.run(main())


def test_body_chunks_go_to_the_servers_own_send_past_the_middleware_wrappers():
    """The start message passes the app's send (with its middleware wrappers); the per-token body
    writes go to the server's send that LocusAPI kept in the scope, with the same bytes."""
    from locus.server.event_stream import SERVER_SEND

    async def main():
        stream, server, wrapped = Stream(), Transport(), []

        async def through_middleware(message):
            wrapped.append(message["type"])
            await server.send(message)

        response = ListenedEventStream(stream, render, lambda exc: f"data: error {exc}\n\n")
        task = asyncio.create_task(response({"type": "http", SERVER_SEND: server.send}, never_disconnects,
                                            through_middleware))
        await asyncio.sleep(0)
        stream.sink.put(output("a"))
        stream.sink.put(output("b", finished=True))
        await asyncio.wait_for(task, 1)
        assert wrapped == ["http.response.start"]
        assert server.bodies == [(b"data: a\n\n", True), (b"data: b\n\ndata: [DONE]\n\n", False)]

    asyncio.run(main())


def test_the_app_keeps_the_servers_send_in_the_scope():
    """Over a real ASGI call: LocusAPI puts the server's send in the scope its routes see."""
    from locus.server.app import LocusAPI
    from locus.server.event_stream import SERVER_SEND

    app = LocusAPI()
    seen = {}

    @app.get("/probe")
    async def probe(request: Request):
        seen["send"] = request.scope.get(SERVER_SEND)
        return {}

    async def main():
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await app({"type": "http", "method": "GET", "path": "/probe", "headers": [], "query_string": b"",
                   "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http", "server": ("t", 80),
                   "root_path": ""}, receive, send)
        assert sent[0]["status"] == 200
        assert seen["send"] is send

    asyncio.run(main())
