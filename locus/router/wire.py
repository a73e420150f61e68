"""The router's HTTP/1.1 connection to its clients: uvicorn's httptools protocol, with a chunked
response's head sent in the same write as its first body piece.

Why: uvicorn writes a response's status line and headers to the socket as soon as the app sends
`http.response.start`, and the first body piece in a second write. The router sends the start of a
stream only once the backend's first chunk is in hand, so the two writes are back to back; as two
they wake the client twice, and on a machine whose cores are all busy the client's first wake-up
(for the head alone) can take the core from the router before the first token is written. As one
write the client wakes once, with its first token. A head is held only when uvicorn frames the body
as chunked (every chunked body write that follows writes bytes: a piece or the terminator), never
for a HEAD request (uvicorn frames none) or a Content-Length answer; closing the connection writes
a head still held.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

CHUNKED_HEAD_END = b"transfer-encoding: chunked\r\n\r\n"  # how uvicorn ends a head whose body it chunks


class HeadWithFirstPiece:
    """A transport that holds a chunked response's head until the next write, and writes both as one.
    Everything else is the wrapped transport's."""

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif data.startswith(b"HTTP/1.1 ") and data.endswith(CHUNKED_HEAD_END):
            self._held = data
            return
        self._transport.write(data)

    def close(self) -> None:
        if self._held is not None:
            self._transport.write(self._held)
            self._held = None
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class RouterHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol writing through HeadWithFirstPiece (`uvicorn.Config(http=...)`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeadWithFirstPiece(transport))  # type: ignore[arg-type]
