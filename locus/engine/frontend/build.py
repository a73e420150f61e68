"""`build_engine`: the one place an engine is assembled from a model name and options, for the server,
the offline CLI and the benches.

One process: load the model (whole), build `EngineCore`, with a placement plan's grouper as its
micro-batch policy when asked. Rank 0 of an expert-parallel server (`ep`): its worker (its expert
slices, the process group, the plan applied) and the driver over every rank, with live re-planning
when configured. Either way the result is an engine backend (core/backend.py) that `AsyncEngine` drives,
or that offline callers step themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from locus.engine.core.backend import EngineBackend, LocalBackend
from locus.engine.checkpoint.loader import LoadedModel, load
from locus.engine.checkpoint.tokenizer import read_chat_template
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.errors import LocusError

if TYPE_CHECKING:
    from locus.engine.frontend.async_engine import AsyncEngine

log = logging.getLogger("locus.engine")


@dataclass
class BuiltEngine:
    backend: EngineBackend
    loaded: LoadedModel  # the model as loaded (its name, whether its weights are random)
    burst_wait_s: float  # what AsyncEngine's burst wait may be for this backend (0 under expert parallelism)

    @property
    def core(self) -> EngineCore:
        return self.backend.core

    def serve(self, **options) -> AsyncEngine:
        """The engine for serving: this backend driven from a background thread, with the burst wait it
        allows (options: AsyncEngine's)."""
        from locus.engine.frontend.async_engine import AsyncEngine  # the EP view it holds: not for offline callers

        return AsyncEngine(self.backend, burst_wait_s=self.burst_wait_s, **options)


def build_engine(model: str | None, *, dtype: str | None = None, device: str | None = None,
                 moe_backend: str = "auto", seed: int = 0, engine_config: EngineConfig | None = None,
                 quantize_experts: str | None = None, plan: str | None = None, plan_loaded=None, ep=None,
                 record_trace: str | None = None, model_name: str = "locus", chat_template: str | None = None,
                 burst_wait_s: float = 0.0) -> BuiltEngine:
    """The engine for `model`. `plan`: a placement plan whose grouper forms the micro-batches (one per
    node) of a single-process engine. `ep` (an EPSetup): this process is rank 0 of several, and the
    setup's plan places the experts. `record_trace`: record every request's routing there.
    `chat_template`: a file or the template itself, replacing the tokenizer's. `burst_wait_s`: the
    idle engine's wait for the rest of a burst; rank 0 of several does not wait (its iteration is
    every rank's, and the others wait on it in a collective)."""
    engine_config = engine_config or EngineConfig()
    if ep is not None:
        backend, loaded = _build_rank0(ep, model, engine_config, dtype=dtype, device=device, moe_backend=moe_backend,
                                       seed=seed, record_trace=record_trace, model_name=model_name,
                                       quantize_experts=quantize_experts)
        burst_wait_s = 0.0
    else:
        loaded = load(model, dtype, device, moe_backend, seed, quantize_experts=quantize_experts)
        grouping = None
        if plan:
            grouping = load_plan_grouping(plan, loaded.model.config, plan_loaded)
            engine_config = replace(engine_config, num_micro_batches=grouping.grouper.topology.nodes)
        core = EngineCore(loaded.model, loaded.tokenizer, engine_config, grouping=grouping)
        if record_trace:
            core.start_recording(record_trace, model_name)
        if grouping is not None:  # the grouper learns each request's expert signature from its prefill
            core.routing.subscribe(grouping.observe)
        backend = LocalBackend(core)
    if chat_template is not None:
        loaded.tokenizer.chat_template = read_chat_template(chat_template)
    return BuiltEngine(backend, loaded, burst_wait_s)


def _build_rank0(setup, model, engine_config, **options):
    """Rank 0's driver over every rank (its own worker included)."""
    from locus.engine.ep.ranks.driver import EPDriver
    from locus.engine.ep.ranks.worker import build_worker
    from locus.engine.ep.rebalance.replan import ReplanSchedule, attach_replanner

    worker, loaded = build_worker(setup, model, engine_config, **options)
    driver = EPDriver(worker)
    if setup.replanning:
        driver.replanner = attach_replanner(driver, ReplanSchedule.parse(setup.replan_every),
                                            setup.replan_layers_per_step, options["model_name"])
    log.info("expert parallelism over %d ranks (%s exchange%s); requests assigned %s", driver.world,
             setup.mode, ", two overlapped micro-batches" if setup.overlap else "", driver.assignment)
    return driver, loaded


def load_plan_grouping(path: str, model_config, loaded=None):
    """The plan's grouper as the engine's micro-batch policy; the plan must fit this model. `loaded`: the
    file as its caller already loaded (and checked) it, else it is read here."""
    from locus.engine.policies.plan_grouping import PlanGrouping
    from locus.routing.plan.placement import PlanError, check_fit, load_plan

    plan = loaded if loaded is not None else load_plan(path)
    try:
        check_fit(plan, num_experts=model_config.num_local_experts, moe_layers=list(model_config.moe_layers))
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None
    if not plan.grouping:
        raise LocusError(f"{path}: the plan has no grouping section (make it with --planner locality)")
    return PlanGrouping.from_plan(plan, model_config.moe_layers, model_config=model_config)
