"""Errors in OpenAI's shape, as Locus's own server writes them (docs/design.md, "Server conventions"):
`{"error": {"message", "type", "param", "code"}}` with the matching status, and inside a stream one
SSE frame with that object, after which the stream ends."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_, param), status_code=status, headers=headers)


def error_frame(status: int, message: str, type_: str = "server_error") -> bytes:
    return f"data: {json.dumps(error_body(status, message, type_))}\n\n".encode()
