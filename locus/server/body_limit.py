"""A request body larger than --max-request-body-bytes is refused before it is read.

A body that declares its size (Content-Length) is refused at once, unread: the server discards the
rest as it arrives and the connection stays usable. A chunked body (no Content-Length) is counted as
it arrives and refused once it passes the limit, so it is never held whole. Both answers are a 400
OpenAI error object naming the flag: a body is held, then parsed, whole, on the event loop every
stream shares.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope

from locus.server.errors import error_body

FLAG = "--max-request-body-bytes"


def too_large_message(limit: int, size: int | None = None) -> str:
    if size is None:  # a chunked body, refused as it passes the limit
        return f"the request body is over {limit} bytes, the most this server accepts ({FLAG})"
    return f"the request body is {size} bytes; this server accepts at most {limit} ({FLAG})"


def declared_length(scope: Scope) -> int | None:
    """The Content-Length header's value (None without one, or if it is not a number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def refusal(limit: int, size: int) -> tuple[dict, bytes]:
    """The ASGI response start and body of the refusal of a declared size."""
    import json

    body = json.dumps(error_body(400, too_large_message(limit, size), "invalid_request_error")).encode()
    start = {"type": "http.response.start", "status": 400,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    return start, body


def limited(receive: Receive, limit: int) -> Receive:
    """`receive` that counts the body and raises a 400 (handled like any HTTPException) past `limit`."""
    seen = 0

    async def receive_limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise HTTPException(400, too_large_message(limit))
        return message

    return receive_limited
