"""The FastAPI app: OpenAI-compatible endpoints over the AsyncEngine.


The model loads in a background thread after the server starts listening, so /health answers 503
("loading") at once and 200 when ready. The endpoints live in routes/, one module per family;
`create_app` assembles them over one `ServerState` (state.py).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from locus.engine.ep.ranks.launch import rank_trace_path
from locus.server import body_limit, openapi
from locus.server.errors import install_handlers
from locus.server.event_stream import SERVER_SEND
from locus.server.routes import completions, ep_admin, health, models, traces
from locus.server.state import ServerConfig, ServerState
from locus.traces.merge import merge_traces

log = logging.getLogger("locus.server")


class LocusAPI(FastAPI):
    """FastAPI that keeps the server's own `send` in the scope, for streamed bodies (event_stream.body_send),
    and refuses a body over --max-request-body-bytes before reading it (body_limit.py)."""

    max_body_bytes: int | None = None

    async def __call__(self, scope, receive, send) -> None:
        scope[SERVER_SEND] = send
        limit = self.max_body_bytes
        if scope["type"] == "http" and limit is not None:
            size = body_limit.declared_length(scope)
            if size is not None and size > limit:
                start, body = body_limit.refusal(limit, size)
                await send(start)
                await send({"type": "http.response.body", "body": body})
                return
            receive = body_limit.limited(receive, limit)
        await super().__call__(scope, receive, send)


def create_app(config: ServerConfig) -> FastAPI:
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="locus-load", daemon=True).start()
        yield
        await shut_down(state)

    app = LocusAPI(title="Locus", lifespan=lifespan)
    app.max_body_bytes = config.limits.max_body_bytes
    app.state.locus = state
    install_handlers(app)
    openapi.install(app, state)
    for family in (health, ep_admin, models, traces, completions):
        app.include_router(family.routes(state))
    return app


async def shut_down(state: ServerState) -> None:
    """At exit: stop admitting, write the trace being recorded, stop the engine (and the re-planner);
    under expert parallelism, merge the ranks' trace parts into the one --record-trace asked for."""
    config, engine = state.config, state.engine
    if engine is not None:
        engine.stop_admitting()
        if engine.recording().state != "idle" and engine.healthy:
            summary = await engine.dump_recording()
            if summary.status == "failed":
                log.warning("trace %s: the recording failed (%s); %s", summary.path, summary.reason,
                            f"{summary.requests} requests kept" if summary.kept else "nothing could be kept")
            else:
                log.info("trace written to %s: %d requests, %d tokens", summary.path, summary.requests,
                         summary.tokens)
        await asyncio.to_thread(engine.shutdown, 10.0)  # a re-planner's temporary files go too
        if config.ep is not None and config.record_trace and not engine.failed:
            # each rank wrote its part under the rank it started as; a rank lost under --ep-elastic wrote none
            ranks = [r for r in range(config.ep.world) if Path(rank_trace_path(config.record_trace, r)).exists()]
            if len(ranks) < config.ep.world:
                log.warning("trace %s: ranks %s wrote no part (lost, or their recording failed and kept "
                            "nothing); their requests are not in it",
                            config.record_trace, sorted(set(range(config.ep.world)) - set(ranks)))
            parts = [rank_trace_path(config.record_trace, r) for r in ranks]
            count = await asyncio.to_thread(merge_traces, parts, config.record_trace, ranks, engine.admission_log())
            for part in parts:
                shutil.rmtree(part, ignore_errors=True)
            log.info("trace written to %s: %d requests from %d ranks", config.record_trace, count, len(ranks))
