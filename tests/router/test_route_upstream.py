"""The router's client to its backends (locus/router/upstream.py) against a scripted HTTP/1.1 server in
the same loop: answers framed every way, kept-alive connections reused, a connection the backend
closed while idle never failing a request, and failures named."""

import asyncio

import pytest

from locus.router.upstream import Upstream, UpstreamError

CHUNKED = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
           b"9\r\ndata: 1\n\n\r\n")
CHUNKED_END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


class Script:
    """A server that answers each request on a connection with the script's next step: bytes to write,
    a callable given (transport, request bytes), or "close" (close without answering)."""

    def __init__(self, *steps):
        self.steps = list(steps)
        self.requests: list[bytes] = []
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.server = None

    async def start(self) -> str:
        script = self

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport):
                script.connections += 1
                self.transport, self.pending = transport, b""

            def data_received(self, data):
                self.pending += data
                head, sep, rest = self.pending.partition(b"\r\n\r\n")
                if not sep:
                    return
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                if len(rest) < length:
                    return
                self.pending = rest[length:]
                script.requests.append(head + sep + rest[:length])
                step = script.steps.pop(0)
                if step == "close":
                    self.transport.close()
                elif callable(step):
                    step(self.transport, script.requests[-1])
                else:
                    self.transport.write(step)

            def eof_received(self):
                script.closed_by_client.set()

            def connection_lost(self, exc):
                script.closed_by_client.set()

        self.server = await asyncio.get_running_loop().create_server(Protocol, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def stop(self):
        self.server.close()


def run(coro):
    return asyncio.run(coro)


def test_a_request_goes_out_whole_and_its_answer_comes_back_by_length():
    async def go():
        script = Script(ok(b'{"a": 1}', b"x-request-id: q1\r\n"))
        base = await script.start()
        client = Upstream()
        r = await client.request(base, "POST", "/v1/completions", b'{"prompt": "x"}', {"X-Request-Id": "q1"})
        assert (r.status, r.headers["x-request-id"], await r.read()) == (200, "q1", b'{"a": 1}')
        head, _, body = script.requests[0].partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/completions HTTP/1.1" and body == b'{"prompt": "x"}'
        assert b"X-Request-Id: q1" in lines and b"Content-Length: 15" in lines and lines[2:3] != [b""]
        assert lines[1] == b"Host: " + base.split("//")[1].encode()
        script.steps.append(ok(b"{}"))  # a request id from a JSON body may hold any character
        await (await client.request(base, "POST", "/v1/completions", b"{}", {"X-Request-Id": "q-\u4e2d-\xe9"})).read()
        assert b"X-Request-Id: q-\xe4\xb8\xad-\xc3\xa9" in script.requests[1].split(b"\r\n")
        client.close()
        script.stop()
    run(go())


def test_a_chunked_stream_is_read_as_it_arrives_and_its_connection_reused():
    async def go():
        later = asyncio.Event()

        def stream(transport, _):
            transport.write(CHUNKED)
            asyncio.get_running_loop().create_task(rest(transport))

        async def rest(transport):
            await later.wait()
            transport.write(CHUNKED_END)

        script = Script(stream, ok(b"second"))
        base = await script.start()
        client = Upstream()
        r = await client.request(base, "POST", "/v1/completions", b"{}")
        assert await r.readany() == b"data: 1\n\n"  # the first event, before the rest is written
        assert 0 < r.sent <= r.first_body  # (the router's own time is measured up to and from these)
        later.set()
        assert await r.readany() == b"data: [DONE]\n\n"
        assert await r.readany() == b""
        r2 = await client.request(base, "GET", "/health")
        assert await r2.read() == b"second"
        assert (script.connections, client.opened) == (1, 1)
        client.close()
        script.stop()
    run(go())


def test_an_answer_without_a_length_ends_with_its_connection():
    async def go():
        def until_close(transport, _):
            transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it")
            transport.close()

        script = Script(until_close)
        base = await script.start()
        client = Upstream()
        r = await client.request(base, "GET", "/x")
        assert await r.read() == b"all of it"
        client.close()
        script.stop()
    run(go())


def test_a_connection_the_backend_closed_while_idle_fails_no_request():
    async def go():
        def answer_then_close(transport, _):
            transport.write(ok(b"1"))
            asyncio.get_running_loop().call_later(0.05, transport.close)

        script = Script(answer_then_close, ok(b"2"))
        base = await script.start()
        client = Upstream()
        assert await (await client.request(base, "GET", "/a")).read() == b"1"
        await asyncio.sleep(0.2)  # the backend closes the idle connection
        assert await (await client.request(base, "GET", "/b")).read() == b"2"
        assert script.connections == 2
        client.close()
        script.stop()
    run(go())


def test_a_reused_connection_closed_as_the_request_goes_out_is_retried_once_on_a_new_one():
    """The backend closes a kept-alive connection just as a request arrives on it (its keep-alive
    timeout): no byte of an answer came, so the request goes again on a new connection."""
    async def go():
        script = Script(ok(b"1"), "close", ok(b"2"))
        base = await script.start()
        client = Upstream()
        assert await (await client.request(base, "GET", "/a")).read() == b"1"
        assert await (await client.request(base, "POST", "/b", b"{}")).read() == b"2"
        assert script.connections == 2 and len(script.requests) == 3
        client.close()
        script.stop()
    run(go())


def test_a_new_connection_closed_before_its_answer_is_a_failure():
    async def go():
        script = Script("close")
        base = await script.start()
        client = Upstream()
        with pytest.raises(UpstreamError, match="closed the connection before the answer began"):
            await client.request(base, "POST", "/v1/completions", b"{}")
        assert len(script.requests) == 1  # not sent twice
        client.close()
        script.stop()
    run(go())


def test_a_stream_cut_mid_answer_raises_and_a_closed_answer_closes_its_connection():
    async def go():
        def cut(transport, _):
            transport.write(CHUNKED)
            asyncio.get_running_loop().call_later(0.02, transport.close)

        script = Script(cut, lambda transport, _: transport.write(CHUNKED))
        base = await script.start()
        client = Upstream()
        r = await client.request(base, "POST", "/v1/completions", b"{}")
        assert await r.readany() == b"data: 1\n\n"
        with pytest.raises(UpstreamError, match="before the answer ended"):
            await r.readany()
        r = await client.request(base, "POST", "/v1/completions", b"{}")  # a new connection
        assert await r.readany() == b"data: 1\n\n"
        script.closed_by_client.clear()
        r.close()  # the client left: the backend sees its connection close
        await asyncio.wait_for(script.closed_by_client.wait(), 5)
        assert client.opened == 2
        client.close()
        script.stop()
    run(go())


def test_a_request_cancelled_before_its_answer_closes_its_connection():
    async def go():
        script = Script(lambda transport, _: None)  # never answers
        base = await script.start()
        client = Upstream()
        task = asyncio.ensure_future(client.request(base, "POST", "/v1/completions", b"{}"))
        while not script.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(script.closed_by_client.wait(), 5)
        client.close()
        script.stop()
    run(go())


def test_an_idle_connection_past_the_idle_timeout_is_not_reused():
    async def go():
        script = Script(ok(b"1"), ok(b"2"))
        base = await script.start()
        client = Upstream(idle_timeout=0.05)
        assert await (await client.request(base, "GET", "/a")).read() == b"1"
        await asyncio.sleep(0.1)
        assert await (await client.request(base, "GET", "/b")).read() == b"2"
        assert script.connections == 2
        client.close()
        script.stop()
    run(go())


def test_failures_are_named():
    async def go():
        client = Upstream(connect_timeout=2)
        with pytest.raises(UpstreamError, match=r"cannot connect to 127\.0\.0\.1:9: "):
            await client.request("http://127.0.0.1:9", "GET", "/health")
        script = Script(lambda transport, _: None, b"NOT HTTP\r\n\r\n")
        base = await script.start()
        with pytest.raises(UpstreamError, match="no answer within 0.1 s"):
            await client.get(base, "/health", 0.1)
        with pytest.raises(UpstreamError, match="not HTTP/1.1"):
            await client.get(base, "/health", 5)
        client.close()
        script.stop()
    run(go())
