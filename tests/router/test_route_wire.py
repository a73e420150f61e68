"""The router's client connection writes a chunked response's head with its first body piece, in one
write (locus/router/wire.py); other answers are written as uvicorn writes them."""

import asyncio
import select
import socket
import threading

import uvicorn

from locus.router.wire import HeadWithFirstPiece, RouterHttpProtocol

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
LENGTH_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"


class Recorder:
    def __init__(self):
        self.writes, self.closed = [], False

    def write(self, data):
        self.writes.append(data)

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


def test_a_chunked_head_goes_out_with_the_first_piece():
    raw = Recorder()
    wire = HeadWithFirstPiece(raw)
    wire.write(CHUNKED_HEAD)
    assert raw.writes == []
    wire.write(b"5\r\nhello\r\n")
    wire.write(b"0\r\n\r\n")
    assert raw.writes == [CHUNKED_HEAD + b"5\r\nhello\r\n", b"0\r\n\r\n"]
    assert not wire.is_closing()  # the rest is the transport's


def test_a_content_length_head_is_written_at_once_and_a_held_head_on_close():
    raw = Recorder()
    wire = HeadWithFirstPiece(raw)
    wire.write(LENGTH_HEAD)
    assert raw.writes == [LENGTH_HEAD]
    wire.write(CHUNKED_HEAD)
    wire.close()
    assert raw.writes == [LENGTH_HEAD, CHUNKED_HEAD] and raw.closed


def test_through_uvicorn_the_client_reads_the_head_and_the_first_piece_together():
    """The app starts its stream and holds its first piece until the client has waited for bytes: with
    uvicorn's own protocol the head arrives alone while it waits, and the client's first read is that."""
    reading = threading.Event()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.get_running_loop().run_in_executor(None, reading.wait, 10)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http=RouterHttpProtocol, ws="none", log_level="error", loop="asyncio"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started and thread.is_alive():
            thread.join(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            select.select([client], [], [], 0.5)  # the head alone would be readable here
            reading.set()
            first = client.recv(65536)
            rest = b""
            while chunk := client.recv(65536):
                rest += chunk
    finally:
        server.should_exit = True
        thread.join(10)
    assert first.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n" in first
    assert (first + rest).endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
