"""The server's configuration and state: the engine it serves (loaded in a background thread), its
metrics, and the checks every request passes before its endpoint's own (routes/)."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from locus.engine.frontend.async_engine import AsyncEngine
from locus.engine.frontend.build import build_engine
from locus.engine.core.engine_core import EngineConfig
from locus.engine.sampling.grammar_limits import CompilePools
from locus.engine.ep.ranks.launch import EPSetup
from locus.engine.sampling.sampler import InvalidParameter
from locus.errors import LocusError, debug_enabled, one_line
from locus.server.errors import APIError
from locus.server.metrics import ServerMetrics
from locus.server.prompts import lone_surrogate_path
from locus.server.protocol import RequestLimits

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
    plan_loaded: object = None  # that plan as the CLI loaded (and checked) it: the file is read once
    ep: EPSetup | None = None  # expert parallelism: this process is rank 0 of several (the plan places experts)
    trace_api: bool = False  # --enable-trace-api: /traces/start|stop|dump
    trace_dir: str = "traces"  # where /traces/start may write (a client names a trace inside it)
    trace_max_bytes: int = 1 << 30  # the whole --trace-dir: a recording stops (and says why) before passing it
    chat_template: str | None = None  # --chat-template: a file or the template itself, replacing the tokenizer's
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may cost (body, prompts, stops)
    quantize_experts: str | None = None  # --quantize-experts: the routed experts' narrow format (docs/formats.md)


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
                                 plan_loaded=c.plan_loaded,
                                 record_trace=c.record_trace, model_name=self.model_name,
                                 chat_template=c.chat_template, burst_wait_s=c.burst_wait_ms / 1000.0)
            engine = built.serve(max_waiting=c.max_waiting, on_dead=self._engine_died)
            self.metrics = ServerMetrics(engine, self.model_name)
            engine.on_finished = self.metrics.observe_output
            engine.start()
            self.engine = engine
            # Everything allocated so far lives as long as the server: keep it out of the GC's
            # generations, so full collections (100+ ms pauses mid-stream) stay short.
            gc.collect()
            gc.freeze()
            if built.loaded.random_weights:
                log.warning("model %r is a preset with RANDOM weights: its text is gibberish", self.model_name)
            log.info("model %r ready: %d KV blocks of %d tokens", self.model_name, engine.info.num_blocks,
                     engine.info.block_size)
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


def reject_lone_surrogates(body) -> None:
    """400 for text that is not Unicode (a JSON "\\ud800" escape with no pair): it could be neither
    tokenized nor written back, and the error message must not echo it."""
    path = lone_surrogate_path(body)
    if path is not None:
        raise InvalidParameter(path, f"{path} contains a lone UTF-16 surrogate, which is not valid Unicode text")
