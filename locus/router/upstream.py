"""The router's HTTP/1.1 client to its backends: one request at a time per connection, kept-alive
connections pooled per backend, answers parsed by httptools (the C parser uvicorn serves with).

Why not a general client: every relayed request pays its client's per-request work on the way out and
on the first chunk back, on the cores the engines share. A request here is one write of bytes built
in one go; the answer's head and each body piece are parser callbacks that append to a buffer; a
reader wakes once per read, not once per HTTP chunk.

What it speaks is what the relay needs: a request with a Content-Length body (or none), an answer
framed by Content-Length, chunked, or the connection's close. No redirects, no compression
(nothing asks for it), no proxies, no 1xx (no request sends `Expect`).

Connections. A finished answer (its last byte parsed, the backend keeping the connection) puts its
connection back in the backend's pool; the next request takes the most recently used one. An idle
connection is used for at most `idle_timeout` seconds (shorter than an engine's keep-alive, uvicorn's
5 s), and one the backend closed while idle is dropped when the close arrives. A reused connection
that closes before the first byte of its answer (the backend closed it just as the request went out)
is not a failure: the request goes again, once, on a new connection, which may fail as itself.
Closing an answer before its end closes the connection, which the engines take as the client gone.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from urllib.parse import urlsplit

import httptools

MAX_BUFFERED = 1 << 20  # bytes of an answer read ahead of its reader before the connection stops reading


class UpstreamError(Exception):
    """A backend's connection failed: refused, reset, timed out, or closed before its answer ended; or
    the answer was not HTTP/1.1."""


class _Stale(Exception):
    """A reused connection closed before its answer's first byte."""


class Upstream:
    """The pooled client. Made on the loop it is used on; `close()` drops the idle connections."""

    def __init__(self, connect_timeout: float = 5.0, idle_timeout: float = 3.0):
        self.connect_timeout, self.idle_timeout = connect_timeout, idle_timeout
        self._idle: dict[str, list[_Connection]] = {}
        self._origins: dict[str, tuple[str, int, bool, bytes]] = {}
        self._ssl: ssl.SSLContext | None = None
        self.opened = 0  # connections opened, ever (a pool that works reuses them)

    async def request(self, base: str, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> "UpstreamResponse":
        """Send a request to `base` (scheme://host:port) and wait for its answer's head. Raises
        UpstreamError; a cancelled wait closes the connection (the backend sees the client go)."""
        host, port, tls, host_header = self._origin(base)
        head = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode("ascii"), path.encode("ascii"), host_header)]
        for name, value in (headers or {}).items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} holds a line break")
            head.append(b"%s: %s\r\n" % (name.encode("latin-1"), _header_bytes(value)))
        if body or method == "POST":
            head.append(b"Content-Length: %d\r\n" % len(body))
        head.append(b"\r\n")
        message = b"".join(head) + body
        connection = self._take(base)
        if connection is not None:
            try:
                return await connection.exchange(message)
            except _Stale:
                pass
        connection = await self._open(base, host, port, tls)
        try:
            return await connection.exchange(message)
        except _Stale:
            raise UpstreamError("the connection closed before the answer began") from None

    async def get(self, base: str, path: str, timeout: float) -> tuple[int, bytes]:
        """A whole GET answer, (status, body), within `timeout` seconds (UpstreamError past it)."""
        try:
            async with asyncio.timeout(timeout):
                response = await self.request(base, "GET", path)
                try:
                    return response.status, await response.read()
                finally:
                    response.close()
        except TimeoutError:
            raise UpstreamError(f"no answer within {timeout:g} s") from None

    def close(self) -> None:
        for connections in self._idle.values():
            for c in connections:
                c.close()
        self._idle.clear()

    # --- the pool -----------------------------------------------------------------------------------
    def _origin(self, base: str) -> tuple[str, int, bool, bytes]:
        origin = self._origins.get(base)
        if origin is None:
            parts = urlsplit(base)
            tls = parts.scheme == "https"
            host_header = parts.netloc.rsplit("@", 1)[-1]  # no user info
            origin = self._origins[base] = (parts.hostname, parts.port or (443 if tls else 80), tls,
                                            host_header.encode("idna"))
        return origin

    def _take(self, base: str) -> "_Connection | None":
        idle = self._idle.get(base)
        now = time.monotonic()
        while idle:
            c = idle.pop()
            if not c.lost and now - c.idle_since < self.idle_timeout:
                return c
            c.close()
        return None

    def _put(self, base: str, connection: "_Connection") -> None:
        connection.idle_since = time.monotonic()
        self._idle.setdefault(base, []).append(connection)

    def _drop(self, base: str, connection: "_Connection") -> None:
        idle = self._idle.get(base)
        if idle and connection in idle:
            idle.remove(connection)

    async def _open(self, base: str, host: str, port: int, tls: bool) -> "_Connection":
        loop = asyncio.get_running_loop()
        if tls and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, base), host, port, ssl=self._ssl if tls else None)
        except TimeoutError:
            raise UpstreamError(f"cannot connect to {host}:{port}: no answer within {self.connect_timeout:g} s") \
                from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
        self.opened += 1
        return connection


class UpstreamResponse:
    """An answer: its status and headers (names lower-case), its body read as it arrives."""

    def __init__(self, connection: "_Connection"):
        self._connection: _Connection | None = connection
        self.status = 0
        self.headers: dict[str, str] = {}
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._done = False  # the body's last byte is parsed
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        # time.perf_counter() when the request's last byte was handed to the socket, and when the read
        # holding the body's first byte came in (the router's own time on a first token is measured
        # up to the one and from the other)
        self.sent = 0.0
        self.first_body: float | None = None

    async def readany(self) -> bytes:
        """What has arrived of the body since the last read (waiting for some); b"" at its end.
        Raises UpstreamError if the connection fails first."""
        while not self._pieces:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._pieces.popleft() if len(self._pieces) == 1 else b"".join(self._pieces)
        self._pieces.clear()
        if self._buffered > MAX_BUFFERED and self._connection is not None:
            self._connection.resume()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while piece := await self.readany():
            parts.append(piece)
        return b"".join(parts)

    def close(self) -> None:
        """Done with the answer: an unfinished one closes its connection."""
        if self._connection is not None and not self._done:
            self._connection.close()
        self._connection = None
        self._done = True

    # --- fed by the connection ----------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._pieces.append(data)
        self._buffered += len(data)
        if self._buffered > MAX_BUFFERED and self._connection is not None:
            self._connection.pause()
        self._wake()

    def _end(self) -> None:
        self._done = True
        self._connection = None
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        self._connection = None
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One TCP connection to a backend, carrying one exchange at a time."""

    def __init__(self, upstream: Upstream, base: str):
        self.upstream, self.base = upstream, base
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.head: asyncio.Future | None = None  # the current exchange's head, until it is parsed
        self.answered = False  # a byte of the current answer has arrived
        self.used = 0  # exchanges begun
        self.lost = False
        self.idle_since = 0.0
        self.paused = False
        self.until_close = False  # the answer has no length: it ends when the connection does
        self.received = 0.0  # time.perf_counter() of the last read

    async def exchange(self, message: bytes) -> UpstreamResponse:
        self.used += 1
        response = self.response = UpstreamResponse(self)
        self.answered = False
        head = self.head = asyncio.get_running_loop().create_future()
        self.transport.write(message)
        response.sent = time.perf_counter()
        try:
            return await head
        except BaseException:
            response.close()  # cancelled (the client left) or failed: an unfinished answer closes the connection
            raise
        finally:
            if self.head is head:  # (a whole answer may have put the connection back, and another taken it)
                self.head = None

    def close(self) -> None:
        if not self.lost:
            self.lost = True
            self.transport.close()
            self.upstream._drop(self.base, self)

    def pause(self) -> None:
        if not self.paused and not self.lost:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.lost:
            self.paused = False
            self.transport.resume_reading()

    # --- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is not safe to reuse
            self.close()
            return
        self.answered = True
        self.received = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._failed(UpstreamError(f"the backend's answer is not HTTP/1.1: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.upstream._drop(self.base, self)
        response = self.response
        if response is None:
            return
        self.response = None
        if self.head is not None and not self.head.done():
            if not self.answered and self.used > 1:
                self.head.set_exception(_Stale())
            else:
                self.head.set_exception(UpstreamError(_closed(exc, "before the answer began")))
        elif self.until_close and exc is None:
            response._end()
        else:
            response._fail(UpstreamError(_closed(exc, "before the answer ended")))

    # --- httptools callbacks ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.response.headers
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text

    def on_headers_complete(self) -> None:
        response = self.response
        response.status = self.parser.get_status_code()
        self.until_close = ("content-length" not in response.headers
                            and "chunked" not in response.headers.get("transfer-encoding", ""))
        if self.head is not None and not self.head.done():
            self.head.set_result(response)

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response.first_body is None:
            response.first_body = self.received
        response._feed(body)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        keep = self.parser.should_keep_alive() and not self.lost
        response._end()
        if keep:
            self.upstream._put(self.base, self)
        else:
            self.close()

    def _failed(self, error: UpstreamError) -> None:
        response, self.response = self.response, None
        if response is None:
            return
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
        else:
            response._fail(error)


def _header_bytes(value: str) -> bytes:
    """A header value as it goes on the wire: a value read from a client's headers (decoded as latin-1,
    as ASGI servers do) goes back byte for byte; one that came from a JSON body (a request id) and
    holds characters latin-1 lacks goes as UTF-8."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


def _closed(exc: Exception | None, when: str) -> str:
    if exc is None:
        return f"the backend closed the connection {when}"
    return f"the connection was lost {when}: {type(exc).__name__}: {exc}"
