"""The router's HTTP app: the OpenAI generation endpoints relayed to the backends, /v1/models (what they
serve), /health (which backends are out) and /metrics.

The two generation endpoints are answered by a plain ASGI function in front of the FastAPI app, which
keeps the rest: a relayed request passes no middleware, no route matching and no Request object on
its way to the relay.

GET /health: 200 `{"status": "ok"}` while every backend is up; 200 `{"status": "degraded", "detail"}`
naming the backends that are out (their ranks take no new request); 503 `{"status": "error"}` when
none is up. Every answer lists the backends with their ranks and state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers

from locus.router.errors import error_response
from locus.router.intake import Intake, Refused
from locus.router.relay import Relay
from locus.router.upstream import Upstream

RELAYED = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # path -> Intake endpoint


def build_app(relay: Relay, intake: Intake, models: dict, on_shutdown=None):
    """The router's ASGI app."""
    pool = relay.pool

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # an idle connection is reused for less than an engine's keep-alive (uvicorn closes idle
        # connections after 5 s), so that a request seldom goes out on a connection the backend is closing
        relay.upstream = Upstream(connect_timeout=5.0, idle_timeout=3.0)
        poller = asyncio.ensure_future(pool.poll(relay.upstream))
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            relay.upstream.close()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="locus route", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def relayed(scope, receive, send, endpoint: str) -> None:
        arrived = time.perf_counter()
        relay.arriving += 1  # until its intake is done: requests ready to go wait for it (Relay.after_arrivals)
        refused = read = None
        try:
            body = await read_body(receive)
            if body is not None:
                read = intake.read(endpoint, body, Headers(scope=scope))
        except Refused as exc:
            refused = exc
        finally:
            relay.arriving -= 1
        if refused is not None:
            await refused.response(scope, receive, send)
            return
        if read is None:
            return  # the client left before its request was whole
        request, outbound = read
        if relay.admissions.in_flight(request.request_id):
            await error_response(400, f"request id {request.request_id!r} is already in flight; request ids must "
                                      "be unique", "invalid_request_error", "request_id")(scope, receive, send)
            return
        await relay.exchange(request, outbound, arrived)(scope, receive, send)

    @app.get("/v1/models")
    async def list_models():
        return models

    @app.get("/health")
    async def health():
        listed = [{"url": b.url, "ranks": list(b.ranks), "status": "up" if b.up else "out",
                   **({} if b.up else {"reason": b.reason})} for b in pool.backends]
        out = pool.out()
        if not out:
            return {"status": "ok", "backends": listed}
        detail = "out: " + "; ".join(f"{b.url} (ranks {','.join(map(str, b.ranks))}): {b.reason}" for b in out)
        if len(out) == len(pool.backends):
            return JSONResponse({"status": "error", "detail": detail, "backends": listed}, status_code=503)
        return {"status": "degraded", "detail": detail, "backends": listed}

    @app.get("/metrics")
    async def metrics():
        return Response(relay.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def router_app(scope, receive, send) -> None:
        endpoint = RELAYED.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await app(scope, receive, send)
        elif scope["method"] == "POST":
            await relayed(scope, receive, send, endpoint)
        else:
            await error_response(405, f"{scope['path']} takes POST, not {scope['method']}", "invalid_request_error",
                                 headers={"Allow": "POST"})(scope, receive, send)

    return router_app


async def read_body(receive) -> bytes | None:
    """The request's body, or None if the client disconnected first."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts)
