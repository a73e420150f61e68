"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the matching status.

No traceback ever reaches a client: unexpected exceptions become a generic 500 (logged server-side).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from locus.engine.frontend.async_engine import EngineDeadError, QueueFullError
from locus.engine.sampling.grammar_limits import GrammarBusy
from locus.engine.sampling.sampler import InvalidParameter
from locus.errors import LocusError

log = logging.getLogger("locus.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(status: int, message: str, type_: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": printable(message), "type": type_, "param": None if param is None else printable(param),
                      "code": code if code is not None else status}}


def printable(text: str) -> str:
    """`text` with lone surrogates written as \\udXXX: an error may quote a client's string, and a
    lone surrogate cannot be encoded as UTF-8 (the response would fail as a 500)."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_json(raw: bytes):
    """A body parsed by hand (not through a schema): any failure is a 400 that says what is wrong."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc.msg}", "invalid_request_error") from None
    except RecursionError:
        raise APIError(400, NESTED_TOO_DEEP, "invalid_request_error") from None
    except ValueError as exc:  # not UTF-8, or an integer literal longer than Python converts
        raise APIError(400, f"malformed JSON body: {exc}", "invalid_request_error") from None


NESTED_TOO_DEEP = "malformed JSON body: it nests deeper than the parser allows (about 1000 levels)"


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the error a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameter):
        return APIError(400, str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "service_unavailable", headers={"Retry-After": "1"})
    if isinstance(exc, GrammarBusy):
        return APIError(503, str(exc), "service_unavailable", headers={"Retry-After": "2"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine is not available", "service_unavailable")
    if isinstance(exc, LocusError):
        return APIError(400, str(exc), "invalid_request_error")
    log.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error", "server_error")


def error_response(exc: BaseException) -> JSONResponse:
    err = to_api_error(exc)
    return JSONResponse(error_body(err.status, err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def sse_error(exc: BaseException) -> str:
    """An error inside a stream: one SSE frame with the error object (the stream then ends)."""
    err = to_api_error(exc)
    return f"data: {json.dumps(error_body(err.status, err.message, err.type, err.param, err.code))}\n\n"


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(400, f"malformed JSON body: {first.get('msg', '')}", "invalid_request_error"), 400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                            f"{str(e.get('msg')).removeprefix('Value error, ')}" for e in errors[:3])
        return JSONResponse(error_body(400, message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's "There was an error parsing the body"
            detail = NESTED_TOO_DEEP
        # a 405 keeps Starlette's Allow header (RFC 9110: it lists the methods the path takes)
        return JSONResponse(error_body(exc.status_code, detail, type_), exc.status_code, headers=exc.headers)

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    # Known errors get their own handlers: Starlette re-raises whatever reaches the catch-all
    # `Exception` handler (to log it as a server error) after sending the response.
    for known in (APIError, LocusError, EngineDeadError, Exception):
        app.add_exception_handler(known, _known)
