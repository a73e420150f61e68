"""Expert-parallel administration: GET /ep/stats (the traffic measured so far) and POST /ep/replan
(re-plan the placement now, --replan-api). Both are 404 on a server without expert parallelism."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from locus.errors import LocusError
from locus.server.errors import APIError, parse_json
from locus.server.state import ServerState


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    config = state.config

    @router.get("/ep/stats")
    async def ep_stats():
        """Expert-parallel traffic measured so far, summed over ranks (replay's field names)."""
        stats = state.engine.ep_stats() if state.engine is not None else None
        if stats is None:
            raise APIError(404, "this server does not run expert parallelism (--ep-ranks)", "not_found_error")
        return stats

    @router.post("/ep/replan")
    async def ep_replan(request: Request):
        """Re-plan the expert placement now (admin, --replan-api): the decision, and the move in progress."""
        from locus.engine.ep.rebalance.replan import ReplanAborted, ReplanBusy

        ep = state.engine.health().ep if state.engine is not None else None
        if ep is None or not ep.replanning or not config.ep.replan_api:
            raise APIError(404, "live re-planning is off (start the server with --ep-ranks N --replan-api)",
                           "not_found_error")
        raw = await request.body()
        body = parse_json(raw) if raw.strip() else {}
        if not isinstance(body, dict) or set(body) - {"force"} or not isinstance(body.get("force", False), bool):
            raise APIError(400, "the body is {} or {\"force\": true|false}", "invalid_request_error", "force")
        engine = state.ready_engine()
        try:
            future = engine.request_replan(body.get("force", False))
        except ReplanBusy as exc:
            raise APIError(409, str(exc), "conflict_error") from None
        try:
            decision = await asyncio.wait_for(asyncio.wrap_future(future), timeout=600)
        except ReplanAborted as exc:  # a rank was lost meanwhile: the survivors' placement stands
            raise APIError(409, str(exc), "conflict_error") from None
        except LocusError as exc:
            raise APIError(422, f"re-plan failed: {exc}", "invalid_request_error") from None
        return decision.to_dict()

    return router
