"""Assembling a router from its flags, every check first: the plan (with a grouping), the backends'
layout in its topology, the tokenizer (and that the plan's prompt predictor was learned for its model),
and that every backend answers and serves the same model. Any problem is one line naming it."""

from __future__ import annotations

from dataclasses import dataclass

from locus.errors import LocusError
from locus.router.admission import Admissions
from locus.router.backends import Backend, BackendPool, describe, lay_out
from locus.router.intake import Intake
from locus.router.metrics import RouterMetrics
from locus.router.prompts import PromptTokenizer, model_shape, tokenizer_for
from locus.router.relay import Relay


@dataclass
class RouterConfig:
    plan: str
    backends: list[str]
    kind: str = "locus"
    tokenizer: str | None = None
    chat_template: str | None = None
    assignment_log: str | None = None
    max_model_len: int | None = None
    health_interval: float = 1.0
    connect_timeout: float = 5.0


@dataclass
class Router:
    config: RouterConfig
    relay: Relay
    intake: Intake
    models: dict  # the /v1/models answer
    log: object | None  # RouteLogWriter

    def app(self):
        from locus.router.app import build_app

        return build_app(self.relay, self.intake, self.models, on_shutdown=self.close)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def assemble(config: RouterConfig) -> Router:
    from locus.routing.grouping.live import live_grouper
    from locus.routing.plan.placement import load_plan

    if config.health_interval <= 0:
        raise LocusError(f"--health-interval must be a positive number of seconds, got {config.health_interval}")
    plan = load_plan(config.plan)
    grouper = live_grouper(plan)  # refuses a plan without a grouping, naming the planner that makes one
    topology = plan.topology
    backends = lay_out(config.backends, topology.ranks, config.kind)
    tokenizer = PromptTokenizer.load(tokenizer_for(plan.model, config.tokenizer), config.chat_template)
    check_predictor(grouper, tokenizer)
    models, max_len = ask_backends(backends, config.connect_timeout)
    if config.max_model_len is not None:
        max_len = config.max_model_len
    if max_len is None:
        raise LocusError("the backends do not say their context limit (/v1/models max_model_len): give --max-model-len")
    log = None
    if config.assignment_log:
        from locus.traces.route_log import RouteLogWriter

        try:
            log = RouteLogWriter(config.assignment_log, {
                "plan": str(config.plan), "topology": {"nodes": topology.nodes, "gpus_per_node": topology.gpus_per_node},
                "backends": [{"url": b.url, "ranks": list(b.ranks)} for b in backends]})
        except OSError as exc:
            raise LocusError(f"--assignment-log {config.assignment_log}: cannot write it ({exc.strerror})") from None
    pool = BackendPool(backends, interval=config.health_interval)
    metrics = RouterMetrics(backends)
    pool.on_change = metrics.backend_changed
    relay = Relay(pool, Admissions(grouper, max_len, log), metrics)
    names = tuple(m["id"] for m in models["data"])
    return Router(config, relay, Intake(tokenizer, config.kind, names), models, log)


def check_predictor(grouper, tokenizer: PromptTokenizer) -> None:
    """The plan's prompt predictor reads token ids of the model it was learned on: refuse another's."""
    table = grouper.predictor
    if table is None:
        return
    shape = model_shape(tokenizer.directory)
    if shape is not None:
        from locus.routing.plan.model_layers import config_moe_layers

        table.check_model(int(shape.get("vocab_size", tokenizer.vocab_size)),
                          config_moe_layers(tokenizer.directory / "config.json"),
                          int(shape.get("num_local_experts", table.num_experts)), f"the model at {tokenizer.directory}")
    elif tokenizer.vocab_size > table.vocab_size:
        raise LocusError(f"the plan's prompt predictor knows {table.vocab_size} token ids, the tokenizer at "
                         f"{tokenizer.directory} has {tokenizer.vocab_size}: they are not the same model's")


def ask_backends(backends: list[Backend], timeout: float) -> tuple[dict, int | None]:
    """Every backend's /v1/models: they must answer, and serve the same model(s). Returns the first's
    answer and the smallest context limit they state."""
    import httpx

    answers = []
    for b in backends:
        where = f"backend {b.url} (rank{'s' if len(b.ranks) > 1 else ''} {','.join(map(str, b.ranks))})"
        try:
            r = httpx.get(f"{b.url}/v1/models", timeout=timeout)
        except httpx.HTTPError as exc:
            raise LocusError(f"{where} is unreachable: {describe(exc)}; start it first, or give its right address") \
                from None
        try:
            data = r.json()["data"]
            ids = tuple(m["id"] for m in data)
        except (ValueError, KeyError, TypeError):
            raise LocusError(f"{where}: /v1/models answered {r.status_code} without an OpenAI model list") from None
        if not ids:
            raise LocusError(f"{where} serves no model (/v1/models is empty)")
        answers.append((b, r.json(), ids))
    first = answers[0]
    for b, _, ids in answers[1:]:
        if ids != first[2]:
            raise LocusError(f"backend {b.url} serves {', '.join(ids)}, backend {first[0].url} serves "
                             f"{', '.join(first[2])}: every rank must serve the same model")
    limits = [m.get("max_model_len") for _, answer, _ in answers for m in answer["data"]]
    limits = [x for x in limits if isinstance(x, int) and not isinstance(x, bool) and x > 0]
    return first[1], (min(limits) if limits else None)
