"""The default load client (`--client raw`): one HTTP/1.1 POST per connection on an asyncio
Protocol that, while the load runs, only records each read with its arrival time; the responses are
parsed after the timed part, each read timed as it arrived.

Why not aiohttp: on a small machine the client shares the cores with the server it measures, so its
CPU per streamed token comes out of the server's forward passes. aiohttp wakes a task and runs its
stream reader for every read (one per token per stream); here a read costs an append in the
transport's callback, and a task wakes once, when the server closes the connection. Parsing the
reads as they came (de-chunking, splitting the SSE events, timing the token chunks) was about a
fifth of this client's CPU during a run (32 x 64 tokens: 40 -> 32 ms); most of the rest is the
event loop's wake-ups and the kernel's socket reads.
What it speaks is what the benchmark needs and no more: `Connection: close` (a fresh connection per
request, no pool; the response ends when the server closes it, as HTTP/1.1 requires of a server
that gets that header), a status line and headers, then a chunked, Content-Length or until-close body.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from serve_lib.load import RequestResult, StreamTally, error_message

MAX_HEAD_BYTES = 64 * 1024  # a response head larger than this is refused, not buffered forever


class ResponseError(Exception):
    """The server's bytes are not a well-formed HTTP/1.1 response."""


class RecordedStream(asyncio.Protocol):
    """One request's connection while the load runs: writes the request on connect, then only
    records each read with its arrival time. The response ends when the server closes the
    connection (the request says `Connection: close`); `finished` gets the RecordedResponse."""

    def __init__(self, request: bytes, recorded: "RecordedResponse", finished: asyncio.Future):
        self.request, self.recorded, self.finished = request, recorded, finished

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.recorded.reads.append((time.perf_counter(), data))

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.recorded.lost = exc
        if not self.finished.done():
            self.finished.set_result(self.recorded)


@dataclass
class RecordedResponse:
    """A response as it arrived: (perf_counter time, bytes) per read, and what its parse needs.
    Parsed by `parse`, after the timed part of the run: the bytes' arrival times are the reads', so
    the figures are those of parsing each read as it comes, without the parsing's CPU on the cores
    the server shares."""
    start: float
    chat: bool
    prompt_len: int | None
    reads: list[tuple[float, bytes]] = field(default_factory=list)
    lost: Exception | None = None  # what closed the connection, if it was not a clean close

    def parse(self) -> RequestResult:
        parser = ResponseParser(StreamTally(self.chat, self.start), self.prompt_len)
        for now, data in self.reads:
            parser.feed(data, now)
            if parser.outcome is not None:
                return parser.outcome
        parser.closed(self.reads[-1][0] if self.reads else time.perf_counter(), self.lost)
        return parser.outcome


class ResponseParser:
    """One response's bytes, fed in the pieces they arrived in, each with its arrival time.

    States: reading the head (status line + headers), then the body. A 200 body is de-chunked and
    fed to the tally; any other status's body is kept whole for its error message. `outcome` is the
    RequestResult once the body ends, the bytes break HTTP or the connection closed."""

    def __init__(self, tally: StreamTally, prompt_len: int | None):
        self.tally, self.prompt_len = tally, prompt_len
        self.outcome: RequestResult | None = None
        self.buffer = b""  # head bytes, or chunked-framing bytes not yet complete
        self.status: int | None = None  # None: still reading the head
        self.framing = "close"  # "chunked", "length" or "close" (the body ends with the connection)
        self.remaining = 0  # "length": body bytes still to come; "chunked": bytes left in the current chunk
        self.in_chunk = False  # "chunked": inside a chunk's data (else: before a size line)
        self.error_body = b""  # a non-200 body
        self.now = 0.0  # the arrival time of the bytes being parsed

    def feed(self, data: bytes, now: float) -> None:
        if self.outcome is not None:
            return
        self.now = now
        try:
            if self.status is None:
                data = self.read_head(data)
                if self.status is None:
                    return
            self.read_body(data)
        except (ResponseError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            self.finish(RequestResult(False, error=f"{type(exc).__name__}: {exc}"))

    def closed(self, now: float, exc: Exception | None) -> None:
        """The connection closed (at `now`, the last bytes' arrival) before the body ended by its framing."""
        if self.outcome is not None:
            return
        self.now = now
        if self.status is not None and self.framing == "close":  # the body ends with the connection
            self.end_body()
        else:
            reason = f": {exc}" if exc else ""
            self.finish(RequestResult(False, error=f"the server closed the connection before the response ended{reason}"))

    # -- parsing --------------------------------------------------------------------------------------
    def read_head(self, data: bytes) -> bytes:
        """Buffer until the blank line after the headers; parse them; return the body bytes after it."""
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise ResponseError(f"no end of the response head within {MAX_HEAD_BYTES} bytes")
            return b""
        head, rest = self.buffer[:end].decode("latin-1"), self.buffer[end + 4:]
        self.buffer = b""
        status_line, *header_lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ResponseError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise ResponseError(f"a header line without ':': {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.framing = "chunked"
        elif "content-length" in headers:
            self.framing, self.remaining = "length", int(headers["content-length"])
        self.status = int(parts[1])
        return rest

    def read_body(self, data: bytes) -> None:
        if self.framing == "chunked":
            self.read_chunks(data)
        elif self.framing == "length":
            data = data[:self.remaining]
            self.remaining -= len(data)
            self.take(data)
            if self.remaining == 0:
                self.end_body()
        else:
            self.take(data)

    def read_chunks(self, data: bytes) -> None:
        """De-chunk what has arrived: every complete piece of chunk data goes to `take` at once (a
        server's write of one token's frame is usually one chunk in one read)."""
        buf, payload = self.buffer + data, []
        pos = 0
        while pos < len(buf):
            if self.in_chunk:
                piece = buf[pos:pos + self.remaining]
                payload.append(piece)
                pos += len(piece)
                self.remaining -= len(piece)
                if self.remaining:
                    break  # the rest of this chunk is in a later read
                self.in_chunk = False
                continue
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                if len(buf) - pos > 1024:
                    raise ResponseError("a chunk size line longer than 1024 bytes")
                break
            size_text = buf[pos:line_end].split(b";", 1)[0].strip()
            if not size_text:  # the CRLF that ends the previous chunk's data
                pos = line_end + 2
                continue
            size = int(size_text, 16)  # ValueError: not chunked framing
            pos = line_end + 2
            if size == 0:  # the last chunk (trailers, if any, are ignored)
                self.buffer = b""
                self.take(b"".join(payload))
                self.end_body()
                return
            self.in_chunk, self.remaining = True, size
        self.buffer = buf[pos:]
        if payload:
            self.take(b"".join(payload))

    def take(self, body: bytes) -> None:
        if not body:
            return
        if self.status != 200:
            self.error_body += body
            return
        self.tally.feed(body, self.now)
        if self.tally.error is not None:
            self.finish(self.tally.result(self.prompt_len, self.now))

    def end_body(self) -> None:
        if self.status != 200:
            self.finish(RequestResult(False, error=f"HTTP {self.status}: {error_message(self.error_body)}"))
        else:
            self.finish(self.tally.result(self.prompt_len, self.now))

    def finish(self, result: RequestResult) -> None:
        self.outcome = result


@dataclass(frozen=True)
class HttpTarget:
    """Where the requests go, parsed once: host, port and the request head up to its length."""
    host: str
    port: int
    head: str  # request line and headers, up to (not including) Content-Length

    @classmethod
    def of(cls, url: str) -> "HttpTarget":
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the raw load client speaks plain http:// only, not {url!r} (use --client aiohttp)")
        port = parts.port or 80
        host = parts.hostname if parts.port is None else f"{parts.hostname}:{port}"
        head = (f"POST {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1\r\nHost: {host}\r\n"
                "Content-Type: application/json\r\nAccept: text/event-stream\r\nConnection: close\r\n")
        return cls(parts.hostname, port, head)

    def request(self, body: dict) -> bytes:
        """The bytes of a JSON POST of body."""
        payload = json.dumps(body).encode()
        return f"{self.head}Content-Length: {len(payload)}\r\n\r\n".encode("latin-1") + payload


async def send_request_raw(target: HttpTarget, body: dict, chat: bool, prompt_len: int | None) -> "RequestResult | RecordedResponse":
    """One streamed request on a connection of its own: a failed connect's RequestResult, or the
    recorded response, to be parsed (`RecordedResponse.parse`) once the timed part is over.
    Cancelling it (the request timeout) closes the connection, which the server sees as a disconnect."""
    loop = asyncio.get_running_loop()
    request = target.request(body)
    finished: asyncio.Future = loop.create_future()
    recorded = RecordedResponse(time.perf_counter(), chat, prompt_len)
    try:
        transport, _ = await loop.create_connection(lambda: RecordedStream(request, recorded, finished), target.host, target.port)
    except OSError as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    try:
        return await finished
    finally:
        transport.close()
