"""The FastAPI app: OpenAI-compatible endpoints over the AsyncEngine.

The model loads in a background thread after the server starts listening, so /health answers 503
("loading") at once and 200 when ready. Every request is validated and admitted completely (schema,
text, sampling ranges, context limit, queue room) before anything streams, so a bad or refused
request gets a proper status code; errors that happen mid-stream are sent as one SSE error frame.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from locus.engine.async_engine import AsyncEngine
from locus.engine.build import build_engine
from locus.engine.outputs import RequestOutput
from locus.engine.engine_core import EngineConfig
from locus.engine.grammar_limits import CompilePools
from locus.engine.ep.ranks.driver import EPDriver
from locus.engine.ep.ranks.launch import EPSetup, rank_trace_path
from locus.engine.ep.ranks.stats import ep_stats_of
from locus.engine.observers.trace_recorder import MIN_TRACE_BYTES, RecordingStorageError
from locus.engine.sampling import InvalidParameter
from locus.errors import LocusError, debug_enabled, one_line
from locus.files import directory_bytes
from locus.server import body_limit, openapi, responses, scoring
from locus.server.errors import APIError, install_handlers, parse_json, sse_error
from locus.server.event_stream import SERVER_SEND, Block, EventStreamResponse, ListenedEventStream, wait_for_disconnect
from locus.server.metrics import ServerMetrics
from locus.traces.merge import merge_traces
from locus.server.prompts import check_text_size, lone_surrogate_path, off_loop_if_large, text_chars
from locus.server.protocol import (
    MAX_DOMAIN_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestLimits,
    TokenizeRequest,
    TraceStartRequest,
)

log = logging.getLogger("locus.server")


@dataclass
class ServerConfig:
    model: str | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    device: str | None = None
    moe_backend: str = "auto"
    seed: int = 0
    engine: EngineConfig = field(default_factory=EngineConfig)  # KV cache, batch limits, prefix caching
    max_waiting: int | None = None
    burst_wait_ms: float = 2.0  # an idle engine's wait for the rest of a burst (AsyncEngine.burst_wait_s)
    record_trace: str | None = None  # record every request's expert routing into this trace directory
    plan: str | None = None  # a placement plan whose grouper forms the micro-batches (one per node)
    ep: EPSetup | None = None  # expert parallelism: this process is rank 0 of several (the plan places experts)
    trace_api: bool = False  # --enable-trace-api: /traces/start|stop|dump
    trace_dir: str = "traces"  # where /traces/start may write (a client names a trace inside it)
    trace_max_bytes: int = 1 << 30  # the whole --trace-dir: a recording stops (and says why) before passing it
    chat_template: str | None = None  # --chat-template: a file or the template itself, replacing the tokenizer's
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may cost (body, prompts, stops)
    quantize_experts: str | None = None  # --quantize-experts: the routed experts' narrow format (docs/formats.md)


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


def recording_status(core) -> dict:
    """GET /traces/status (and what /traces/stop answers): the recording's state, counts, budget and,
    when it stopped or failed, why. The trace is named, not located (the server's paths stay its own)."""
    recorder = core.recorder
    if recorder is None:
        return {"state": "idle", "recording_failures": core.recording_failures}
    return {"state": recorder.state, "name": recorder.path.name, "requests": recorder.requests,
            "tokens": recorder.tokens, "bytes": recorder.written_bytes, "max_bytes": recorder.max_bytes,
            "stop_reason": recorder.stop_reason, "reason": recorder.failure,
            "recording_failures": core.recording_failures}


def served_name(model: str | None, served_model_name: str | None) -> str:
    """The name /v1/models reports (and traces record): --served-model-name, else the model dir's name."""
    return served_model_name or (model or "tiny").rstrip("/").split("/")[-1]


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.engine: AsyncEngine | None = None
        self.metrics: ServerMetrics | None = None
        self.model_name = served_name(config.model, config.served_model_name)
        self.load_error: str | None = None
        self.on_load_failed = None  # callable; `locus serve` uses it to exit instead of serving 503s
        self.on_engine_dead = None  # callable; `locus serve` uses it to exit non-zero
        self.ep_driver: EPDriver | None = None
        self.created = int(time.time())
        self.compile_pools = CompilePools(config.engine.grammar_limits)

    def load(self) -> None:
        try:
            c = self.config
            if c.trace_api:  # the one place /traces/start writes into: there from the start
                Path(c.trace_dir).mkdir(parents=True, exist_ok=True)
            # under expert parallelism the plan places the experts over the ranks; this rank loads only its own
            built = build_engine(c.model, dtype=c.dtype, device=c.device, moe_backend=c.moe_backend, seed=c.seed,
                                 engine_config=c.engine, quantize_experts=c.quantize_experts, plan=c.plan, ep=c.ep,
                                 record_trace=c.record_trace, model_name=self.model_name,
                                 chat_template=c.chat_template, burst_wait_s=c.burst_wait_ms / 1000.0)
            core, loaded = built.core, built.loaded
            if isinstance(built.backend, EPDriver):
                self.ep_driver = built.backend
            engine = AsyncEngine(built.backend, max_waiting=c.max_waiting, on_dead=self._engine_died,
                                 burst_wait_s=built.burst_wait_s)
            self.metrics = ServerMetrics(engine, self.model_name, self.ep_driver)
            engine.on_finished = self.metrics.observe_output
            engine.start()
            self.engine = engine
            # Everything allocated so far lives as long as the server: keep it out of the GC's
            # generations, so full collections (100+ ms pauses mid-stream) stay short.
            gc.collect()
            gc.freeze()
            if loaded.random_weights:
                log.warning("model %r is a preset with RANDOM weights: its text is gibberish", self.model_name)
            log.info("model %r ready: %d KV blocks of %d tokens", self.model_name, core.blocks.num_blocks, core.blocks.block_size)
        except Exception as exc:  # reported by /health (and by `locus serve` in one line as it exits)
            if debug_enabled():
                log.exception("model failed to load")
            self.load_error = one_line(exc)
            if not isinstance(exc, LocusError) and not debug_enabled():
                self.load_error += " (run with --debug for the traceback)"
            if self.on_load_failed is not None:
                self.on_load_failed()

    def _engine_died(self, exc: BaseException) -> None:
        # the engine thread already logged the traceback and failed every request in flight
        if self.on_engine_dead is not None:
            self.on_engine_dead()

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise APIError(503, self.load_error or "the model is still loading", "service_unavailable")
        if not self.engine.healthy:
            raise APIError(503, "the engine is not healthy", "service_unavailable")
        return self.engine

    def accept(self, body) -> AsyncEngine:
        """The checks every generation and tokenizer request passes first: a ready engine, the
        request limits, Unicode text (before anything echoes it), this model, no unsupported field."""
        engine = self.ready_engine()
        self.config.limits.check(body)
        reject_lone_surrogates(body)
        self.check_model(body.model)
        if hasattr(body, "check_unsupported"):
            body.check_unsupported()
        return engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.config.model):
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model", "model_not_found")


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


def reject_lone_surrogates(body) -> None:
    """400 for text that is not Unicode (a JSON "\\ud800" escape with no pair): it could be neither
    tokenized nor written back, and the error message must not echo it."""
    path = lone_surrogate_path(body)
    if path is not None:
        raise InvalidParameter(path, f"{path} contains a lone UTF-16 surrogate, which is not valid Unicode text")


def health_of(state: ServerState):
    """GET /health: 200 `ok`; 200 `degraded` (expert parallelism serving on fewer ranks than it started
    with, after a lost rank); 503 `loading`; 503 `recovering` (the survivors of a lost rank are
    regrouping: requests admitted meanwhile wait for it; Retry-After); 503 `error` (the model failed to
    load, or the engine stopped: the server is exiting). docs/expert_parallel.md lists them."""
    engine, driver = state.engine, state.ep_driver
    if engine is None:
        if state.load_error:
            return JSONResponse({"status": "error", "detail": state.load_error}, status_code=503)
        return JSONResponse({"status": "loading", "detail": None}, status_code=503)
    if not engine.healthy:
        error = engine.error
        detail = f"the engine stopped: {type(error).__name__}: {error}" if error is not None else "the engine stopped"
        return JSONResponse({"status": "error", "detail": detail}, status_code=503)
    if driver is not None and driver.recovering:
        return JSONResponse({"status": "recovering", "detail": "a rank was lost; the survivors are regrouping (requests "
                             "admitted meanwhile wait for it)"}, status_code=503, headers={"Retry-After": "2"})
    if driver is not None and state.config.ep is not None and driver.world < state.config.ep.world:
        lost = sorted(set(range(state.config.ep.world)) - set(driver.worker.members))
        return {"status": "degraded", "detail": f"serving on {driver.world} of {state.config.ep.world} expert-parallel "
                                                f"ranks; lost: {lost}"}
    return {"status": "ok"}


def create_app(config: ServerConfig) -> FastAPI:
    state = ServerState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=state.load, name="locus-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.stop_admitting()
            if state.engine.core.recorder is not None and state.engine.healthy:
                summary = await state.engine.call(lambda core: core.dump_recording())
                if summary.status == "failed":
                    log.warning("trace %s: the recording failed (%s); %s", summary.path, summary.reason,
                                f"{summary.requests} requests kept" if summary.kept else "nothing could be kept")
                else:
                    log.info("trace written to %s: %d requests, %d tokens", summary.path, summary.requests,
                             summary.tokens)
            await asyncio.to_thread(state.engine.shutdown, 10.0)
            if state.ep_driver is not None and state.ep_driver.replanner is not None:
                await asyncio.to_thread(state.ep_driver.replanner.close)  # its temporary files go too
            if config.ep is not None and config.record_trace and not state.engine.failed:
                # each rank wrote its part under the rank it started as; a rank lost under --ep-elastic wrote none
                ranks = [r for r in range(config.ep.world) if Path(rank_trace_path(config.record_trace, r)).exists()]
                if len(ranks) < config.ep.world:
                    log.warning("trace %s: ranks %s wrote no part (lost, or their recording failed and kept "
                                "nothing); their requests are not in it",
                                config.record_trace, sorted(set(range(config.ep.world)) - set(ranks)))
                parts = [rank_trace_path(config.record_trace, r) for r in ranks]
                driver = state.ep_driver
                admissions = driver.admissions.records if driver is not None and driver.admissions is not None else None
                count = await asyncio.to_thread(merge_traces, parts, config.record_trace, ranks, admissions)
                for part in parts:
                    shutil.rmtree(part, ignore_errors=True)
                log.info("trace written to %s: %d requests from %d ranks", config.record_trace, count, len(ranks))

    app = LocusAPI(title="Locus", lifespan=lifespan)
    app.max_body_bytes = config.limits.max_body_bytes
    app.state.locus = state
    install_handlers(app)
    openapi.install(app, state)

    @app.get("/health")
    async def health():
        return health_of(state)

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response("", media_type="text/plain; version=0.0.4")
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/ep/stats")
    async def ep_stats():
        """Expert-parallel traffic measured so far, summed over ranks (replay's field names)."""
        driver = state.ep_driver
        if driver is None:
            raise APIError(404, "this server does not run expert parallelism (--ep-ranks)", "not_found_error")
        return ep_stats_of(driver)

    @app.post("/ep/replan")
    async def ep_replan(request: Request):
        """Re-plan the expert placement now (admin, --replan-api): the decision, and the move in progress."""
        from locus.engine.ep.rebalance.replan import ReplanAborted, ReplanBusy

        driver = state.ep_driver
        if driver is None or driver.replanner is None or not config.ep.replan_api:
            raise APIError(404, "live re-planning is off (start the server with --ep-ranks N --replan-api)",
                           "not_found_error")
        raw = await request.body()
        body = parse_json(raw) if raw.strip() else {}
        if not isinstance(body, dict) or set(body) - {"force"} or not isinstance(body.get("force", False), bool):
            raise APIError(400, "the body is {} or {\"force\": true|false}", "invalid_request_error", "force")
        engine = state.ready_engine()
        try:
            future = driver.replanner.request(body.get("force", False))
        except ReplanBusy as exc:
            raise APIError(409, str(exc), "conflict_error") from None
        engine.wake()
        try:
            decision = await asyncio.wait_for(asyncio.wrap_future(future), timeout=600)
        except ReplanAborted as exc:  # a rank was lost meanwhile: the survivors' placement stands
            raise APIError(409, str(exc), "conflict_error") from None
        except LocusError as exc:
            raise APIError(422, f"re-plan failed: {exc}", "invalid_request_error") from None
        return decision.to_dict()

    @app.get("/v1/models")
    async def models():
        engine = state.engine
        max_len = engine.core.max_model_len if engine else None
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "locus", "root": config.model or "tiny", "max_model_len": max_len}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        engine = state.ready_engine()
        return scoring.tokenizer_info(engine.core.tokenizer, engine.core.max_model_len)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        engine = state.accept(body)
        tok = engine.core.tokenizer
        # the completion endpoints' limits: a text that cannot fit the context is refused untokenized,
        # a large one is tokenized off the event loop
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            chars = text_chars(messages)
            check_text_size(chars, tok, engine.core.max_model_len, "messages")
            ids = await off_loop_if_large(chars, lambda: tok.encode(
                tok.apply_chat_template(messages, body.add_generation_prompt), add_special_tokens=False))
        else:
            chars = len(body.prompt)
            check_text_size(chars, tok, engine.core.max_model_len, "prompt")
            ids = await off_loop_if_large(chars, lambda: tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        answer = {"tokens": ids, "count": len(ids), "max_model_len": engine.core.max_model_len}
        if body.return_token_strs:
            answer["token_strs"] = scoring.token_strings(tok, ids)
        return answer

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        engine = state.ready_engine()
        reject_lone_surrogates(body)
        state.check_model(body.model)
        vocab, limit = engine.core.model.config.vocab_size, engine.core.max_model_len
        if len(body.tokens) > limit:  # no prompt or output of this model is longer
            raise InvalidParameter("tokens", f"{len(body.tokens)} tokens; this model's context limit is {limit}")
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter("tokens", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        text = await off_loop_if_large(len(body.tokens) * 4, lambda: engine.core.tokenizer.decode(body.tokens))
        return {"prompt": text}

    def recording_engine() -> AsyncEngine:
        if not config.trace_api:
            raise APIError(404, "the trace API is off (start the server with --enable-trace-api)", "not_found_error")
        engine = state.ready_engine()
        if state.ep_driver is not None:
            raise APIError(400, "recording on demand is not supported under expert parallelism yet; "
                                "start the server with --record-trace", "invalid_request_error")
        return engine

    @app.post("/traces/start")
    async def traces_start(body: TraceStartRequest):
        engine = recording_engine()
        recorder = engine.core.recorder
        if recorder is not None:  # its name only: the server's paths are not a client's business
            raise APIError(400, f"already recording trace {recorder.path.name!r} ({recorder.state}); "
                                "POST /traces/dump first", "invalid_request_error")
        name = body.path or default_trace_name(config.trace_dir, state.model_name)
        path = trace_path(config.trace_dir, name)
        budget = await asyncio.to_thread(trace_budget, config.trace_dir, config.trace_max_bytes)
        try:
            await engine.call(lambda core: core.start_recording(path, state.model_name, budget))
        except RecordingStorageError as exc:
            raise APIError(507, str(exc), "insufficient_storage") from None
        return {"status": "recording", "path": str(path)}

    @app.get("/traces/status")
    async def traces_status():
        return await recording_engine().call(recording_status)

    @app.post("/traces/stop")
    async def traces_stop():
        def stop(core):
            core.stop_recording()
            return recording_status(core)

        status = await recording_engine().call(stop)
        return {**status, "status": "failed" if status["state"] == "failed" else "stopped"}

    @app.post("/traces/dump")
    async def traces_dump():
        summary = await recording_engine().call(lambda core: core.dump_recording())
        return summary.__dict__

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        engine = state.accept(body)
        params = body.sampling_params(body.max_tokens, body.logprobs, body.engine_prompt_logprobs())
        tok, chars = engine.core.tokenizer, text_chars(body.prompt)
        if isinstance(body.prompt, str):
            check_text_size(chars, tok, engine.core.max_model_len, "prompt")
        elif body.prompt and isinstance(body.prompt[0], str):
            for text in body.prompt:
                check_text_size(len(text), tok, engine.core.max_model_len, "prompt")
        prompts = await off_loop_if_large(chars, lambda: responses.completion_prompts(body.prompt, tok,
                                                                                      body.add_special_tokens))
        fmt = responses.CompletionFormat.for_request(state.model_name, tok, body)
        return await serve(raw, engine, prompts, params, body, "cmpl", fmt)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        engine = state.accept(body)
        params = body.sampling_params(body.effective_max_tokens, body.logprobs_count)
        tok = engine.core.tokenizer
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        chars = text_chars(messages)
        check_text_size(chars, tok, engine.core.max_model_len, "messages")
        prompt = await off_loop_if_large(chars, lambda: tok.encode(
            tok.apply_chat_template(messages, body.add_generation_prompt), add_special_tokens=body.add_special_tokens))
        return await serve(raw, engine, [prompt], params, body, "chatcmpl", responses.ChatFormat(state.model_name, tok))

    async def compile_constraint(engine: AsyncEngine, so) -> None:
        """Compile (and check) an output constraint in the compile pools; past its time budget the
        request is refused and the compile's result only goes to the cache (grammar_limits.py)."""
        grammars = engine.core.grammars
        if grammars.is_compiled(so):
            return
        if not grammars.prepared:  # the server's one-time cost (xgrammar's import, the vocabulary): not timed
            await asyncio.get_running_loop().run_in_executor(None, grammars.prepare)
        future = state.compile_pools.submit(so, grammars.check_satisfiable)
        seconds = grammars.limits.compile_seconds
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=seconds)
        except asyncio.TimeoutError:
            raise InvalidParameter(so.param, f"the {so.kind} constraint did not compile within {seconds:g} s "
                                             "(--max-grammar-compile-seconds)") from None

    async def serve(raw: Request, engine: AsyncEngine, prompts, params, body, prefix: str, fmt):
        if params.structured is not None:  # compiling can take a while: in its pool, within its budget
            await compile_constraint(engine, params.structured)
        # Everything that can refuse the request does so here, before a byte is sent: validation,
        # then admission, synchronously (no await in between), so the queue limit is exact.
        for p in prompts:
            engine.core.validate(p, params)
        engine.check_admission(len(prompts))
        request_id = f"{prefix}-{body.request_id or uuid.uuid4().hex[:24]}"
        domain = body.domain or raw.headers.get("x-locus-domain")
        if domain is not None and len(domain) > MAX_DOMAIN_CHARS:
            raise InvalidParameter("domain", f"the domain (X-Locus-Domain) may be at most {MAX_DOMAIN_CHARS} characters")
        final_only = not body.stream  # a whole response needs only each request's finished output
        streams = []
        try:
            for i, p in enumerate(prompts):
                streams.append(engine.add(p, params, f"{request_id}-{i}", domain, final_only))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if len(streams) == 1:  # the usual case: written from the engine's per-step delivery
                return ListenedEventStream(streams[0], frame_renderer(fmt, request_id, params.n, include_usage), sse_error,
                                           "".join(fmt.stream_start(request_id, 1, params.n)), headers)
            return EventStreamResponse(stream_events(streams, params.n, request_id, fmt, include_usage), headers)
        finals = await until_disconnected(raw, collect_all(streams))
        if finals is None:
            return Response(status_code=499)  # client gone; nobody reads this
        return JSONResponse(fmt.full_response(request_id, finals, params.n))

    return app


async def collect_all(streams):
    async def last(stream):
        final = None
        async for out in stream:
            final = out
        return final

    try:
        return await asyncio.gather(*(last(s) for s in streams))
    finally:  # one prompt's error (or the caller's cancellation) ends the others too
        for stream in streams:
            await stream.aclose()


async def until_disconnected(raw: Request, coro):
    """Run coro; if the client disconnects first, cancel it (which aborts the engine requests).

    A watcher waits for the server's disconnect message instead of polling: a poll every 0.25 s
    per request ran an anyio cancel scope on the event loop, which shares the cores (and the GIL)
    with the forward pass."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


def frame_renderer(fmt, request_id: str, n: int, include_usage: bool) -> Callable[[RequestOutput], Block]:
    """One prompt's outputs -> SSE text: every frame of an output in one block; the finished output's
    block also carries the usage chunk (if asked) and `[DONE]`, and ends the body."""
    usage = responses.Usage()

    def render(out: RequestOutput) -> Block:
        text = "".join(fmt.stream_chunk(request_id, 0, n, out, usage))
        if not out.finished:
            return text, False
        return text + stream_end(fmt, request_id, usage, include_usage), True

    return render


def stream_end(fmt, request_id: str, usage: "responses.Usage", include_usage: bool) -> str:
    """What closes every stream: the usage chunk (when asked for), then `[DONE]`."""
    return (fmt.usage_chunk(request_id, usage) if include_usage else "") + "data: [DONE]\n\n"


async def stream_events(streams, n: int, request_id: str, fmt, include_usage: bool) -> AsyncIterator[Block]:
    """The SSE text of several prompts' output streams, one block per engine output (one write
    each); the block that ends the body carries the usage chunk and `[DONE]`. An error inside a
    stream becomes one error frame, which ends the body. Closing this generator (client gone)
    closes the streams, which aborts their requests."""
    usage = responses.Usage()
    start = "".join(fmt.stream_start(request_id, len(streams), n))
    if start:
        yield start, False
    merged = merge_streams(streams)
    try:
        async for i, item in merged:
            if isinstance(item, BaseException):
                yield sse_error(item), True
                return
            try:
                text = "".join(fmt.stream_chunk(request_id, i, n, item, usage))
            except Exception as exc:  # noqa: BLE001 - sent to the client as an SSE error frame
                yield sse_error(exc), True
                return
            if text:
                yield text, False
    finally:
        await merged.aclose()
    yield stream_end(fmt, request_id, usage, include_usage), True


async def merge_streams(streams):
    """(prompt index, output or error) from every stream, in arrival order; an error ends the merge."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - forwarded to the client as an SSE error frame
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(tasks)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            yield i, item
            if isinstance(item, BaseException):
                return
    finally:
        for t in tasks:
            t.cancel()
