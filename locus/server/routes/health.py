"""Liveness and metrics: GET /health (the server's state, docs/expert_parallel.md lists them) and
GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from locus.server.state import ServerState


def health_of(state: ServerState):
    """GET /health: 200 `ok`; 200 `degraded` (expert parallelism serving on fewer ranks than it started
    with, after a lost rank); 503 `loading`; 503 `recovering` (the survivors of a lost rank are
    regrouping: requests admitted meanwhile wait for it; Retry-After); 503 `error` (the model failed to
    load, or the engine stopped: the server is exiting). docs/expert_parallel.md lists them."""
    engine = state.engine
    if engine is None:
        if state.load_error:
            return JSONResponse({"status": "error", "detail": state.load_error}, status_code=503)
        return JSONResponse({"status": "loading", "detail": None}, status_code=503)
    health = engine.health()
    if not health.running:
        error = health.error
        detail = f"the engine stopped: {type(error).__name__}: {error}" if error is not None else "the engine stopped"
        return JSONResponse({"status": "error", "detail": detail}, status_code=503)
    ep = health.ep
    if ep is not None and ep.recovering:
        return JSONResponse({"status": "recovering", "detail": "a rank was lost; the survivors are regrouping (requests "
                             "admitted meanwhile wait for it)"}, status_code=503, headers={"Retry-After": "2"})
    if ep is not None and ep.lost:
        return {"status": "degraded", "detail": f"serving on {len(ep.serving)} of {ep.started} expert-parallel "
                                                f"ranks; lost: {ep.lost}"}
    return {"status": "ok"}


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        return health_of(state)

    @router.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response("", media_type="text/plain; version=0.0.4")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router
