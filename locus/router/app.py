"""The router's HTTP app: the OpenAI generation endpoints relayed to the backends, /v1/models (what they
serve), /health (which backends are out) and /metrics.

GET /health: 200 `{"status": "ok"}` while every backend is up; 200 `{"status": "degraded", "detail"}`
naming the backends that are out (their ranks take no new request); 503 `{"status": "error"}` when
none is up. Every answer lists the backends with their ranks and state.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from locus.router.errors import error_response
from locus.router.intake import Intake, Refused
from locus.router.relay import Relay


def build_app(relay: Relay, intake: Intake, models: dict, on_shutdown=None) -> FastAPI:
    pool = relay.pool

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # keep-alive shorter than an engine's (uvicorn closes idle connections after 5 s), so that a
        # request never goes out on a connection the backend is closing
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
        relay.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=5.0), auto_decompress=False, read_bufsize=1 << 16)
        poller = asyncio.ensure_future(pool.poll(relay.session))
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await relay.session.close()
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(title="locus route", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def relayed(raw: Request, endpoint: str):
        arrived = time.perf_counter()
        try:
            request, outbound = intake.read(endpoint, await raw.body(), raw.headers)
        except Refused as refused:
            return refused.response
        if relay.admissions.in_flight(request.request_id):
            return error_response(400, f"request id {request.request_id!r} is already in flight; request ids must "
                                       "be unique", "invalid_request_error", "request_id")
        return relay.exchange(request, outbound, arrived)

    async def completions(raw: Request):
        return await relayed(raw, "completions")

    async def chat(raw: Request):
        return await relayed(raw, "chat")

    # plain Starlette routes: the body is read raw, and FastAPI's per-request dependency solving
    # (a fifth of the router's own time on a request) has nothing to do
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    app.router.add_route("/v1/chat/completions", chat, methods=["POST"])

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

    return app
