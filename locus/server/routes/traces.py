"""Recording expert-routing traces on demand (--enable-trace-api): POST /traces/start, GET
/traces/status, POST /traces/stop, POST /traces/dump, into the server's --trace-dir."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from fastapi import APIRouter

from locus.engine.frontend.async_engine import AsyncEngine
from locus.engine.frontend.health import RecordingState
from locus.engine.observers.trace_recorder import MIN_TRACE_BYTES, RecordingStorageError
from locus.engine.sampling.sampler import InvalidParameter
from locus.files import directory_bytes
from locus.server.errors import APIError
from locus.server.protocol import TraceStartRequest
from locus.server.state import ServerState


TRACE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def trace_path(trace_dir: str, name: str) -> Path:
    """Where /traces/start may record `name`: a plain name inside the --trace-dir (created if missing),
    never an absolute path, `..`, a separator, or a symlink out of it (a 400), nor an existing trace (409)."""
    if not TRACE_NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidParameter("path", "a trace name inside the server's --trace-dir: letters, digits, '.', '_', '-' "
                                       "(at most 128, not starting with '.' or '-'); no path separators")
    root = Path(trace_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise APIError(503, f"the trace directory cannot be created: {exc.strerror}", "service_unavailable") from None
    path = root / name
    if path.is_symlink() or path.resolve().parent != root.resolve():
        raise InvalidParameter("path", "the trace name resolves outside the server's --trace-dir")
    if path.exists():
        raise APIError(409, f"a trace named {name!r} already exists in the trace directory; choose another name",
                       "conflict_error", "path")
    return path


def default_trace_name(trace_dir: str, model_name: str) -> str:
    """<model>-<YYYYmmdd-HHMMSS>, with -2, -3, ... where a trace of that second exists already."""
    stem = f"{model_name}-{time.strftime('%Y%m%d-%H%M%S')}"[:120]
    root, name, n = Path(trace_dir), stem, 1
    while (root / name).exists():
        n += 1
        name = f"{stem}-{n}"
    return name


def trace_budget(trace_dir: str, max_bytes: int) -> int:
    """What a new recording may still write: --trace-max-bytes less every byte already in --trace-dir
    (507 when that is not even an empty trace's worth)."""
    used = directory_bytes(trace_dir)
    left = max_bytes - used
    if left < MIN_TRACE_BYTES:
        raise APIError(507, f"the trace directory holds {used} bytes of the {max_bytes} --trace-max-bytes allows; "
                            "delete traces from it to record more", "insufficient_storage")
    return left


def recording_status(recording: RecordingState) -> dict:
    """GET /traces/status (and what /traces/stop answers): the recording's state, counts, budget and,
    when it stopped or failed, why. The trace is named, not located (the server's paths stay its own)."""
    if recording.state == "idle":
        return {"state": "idle", "recording_failures": recording.failures}
    return {"state": recording.state, "name": recording.name, "requests": recording.requests,
            "tokens": recording.tokens, "bytes": recording.written_bytes, "max_bytes": recording.max_bytes,
            "stop_reason": recording.stop_reason, "reason": recording.failure,
            "recording_failures": recording.failures}


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    config = state.config

    def recording_engine() -> AsyncEngine:
        if not config.trace_api:
            raise APIError(404, "the trace API is off (start the server with --enable-trace-api)", "not_found_error")
        engine = state.ready_engine()
        if engine.health().ep is not None:
            raise APIError(400, "recording on demand is not supported under expert parallelism yet; "
                                "start the server with --record-trace", "invalid_request_error")
        return engine

    @router.post("/traces/start")
    async def traces_start(body: TraceStartRequest):
        engine = recording_engine()
        recording = engine.recording()
        if recording.state != "idle":  # its name only: the server's paths are not a client's business
            raise APIError(400, f"already recording trace {recording.name!r} ({recording.state}); "
                                "POST /traces/dump first", "invalid_request_error")
        name = body.path or default_trace_name(config.trace_dir, state.model_name)
        path = trace_path(config.trace_dir, name)
        budget = await asyncio.to_thread(trace_budget, config.trace_dir, config.trace_max_bytes)
        try:
            await engine.start_recording(path, state.model_name, budget)
        except RecordingStorageError as exc:
            raise APIError(507, str(exc), "insufficient_storage") from None
        return {"status": "recording", "path": str(path)}

    @router.get("/traces/status")
    async def traces_status():
        return recording_status(await recording_engine().recording_between_steps())

    @router.post("/traces/stop")
    async def traces_stop():
        status = recording_status(await recording_engine().stop_recording())
        return {**status, "status": "failed" if status["state"] == "failed" else "stopped"}

    @router.post("/traces/dump")
    async def traces_dump():
        summary = await recording_engine().dump_recording()
        return summary.__dict__

    return router
