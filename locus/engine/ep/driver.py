"""One engine loop for every rank of an expert-parallel server (nano-vllm's ModelRunner-per-rank,
with the control plane on a gloo group).

Every rank repeats the same iteration, so the collectives always line up:
    1. rank 0 broadcasts the commands it took since the last iteration (requests assigned to a rank,
       aborts, stop); each rank applies the ones addressed to it;
    2. the ranks agree whether any of them has work; if so, every rank runs `EngineCore.step()` (in
       lockstep: see EPContext.agree/idle);
    3. every rank sends rank 0 its outputs, its engine counters, its exchange counters and times.
Rank 0 runs this inside AsyncEngine's thread (`EPDriver` is its `driver`); the other ranks run
`serve_rank` until rank 0 says stop. Rank 0 iterates at least every half second while idle, so a
waiting rank's collective never hits the timeout.

Requests are assigned to a rank at admission and stay there (their KV cache lives there):
- `balanced` (no plan, or a plan without a grouping): the rank with the fewest tokens in flight
  (prompt plus n * max_tokens of its unfinished requests), ties to the lowest rank;
- `grouper` (a plan with a grouping): the plan's micro-batch grouper admits it, by domain tag to the
  domain's nodes in the plan's proportions, then the least-loaded rank of the node within the
  attention cap (locus/routing/grouping/grouper.py). It does not move a request after its prefill:
  that would move its KV cache between ranks.

Time, per rank, over the iterations that ran a step (`StepTimes`): the step's wall time, the part in
control collectives (commands, agreement, forward counts, reports), the part in the MoE exchanges
(less the local expert compute); compute is the rest. A report carries the totals as of the previous
iteration's gather.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from locus.engine.engine_core import EngineCore, EngineStats
from locus.engine.ep.layer import EPContext, StepTimes
from locus.engine.outputs import RequestOutput
from locus.engine.sampling import SamplingParams
from locus.errors import LocusError
from locus.engine.ep.exchange import ExchangeCounters
from locus.routing.grouping.grouper import Grouper
from locus.routing.plan.grouping_spec import spec_of

log = logging.getLogger("locus.engine")


@dataclass
class RankReport:
    """What one rank sends rank 0 after an iteration."""

    outputs: list[RequestOutput]
    errors: list[tuple[str, str]]  # (request id, message) of adds this rank refused
    stats: EngineStats
    counters: ExchangeCounters
    times: StepTimes
    expert_bytes: int  # this rank's expert weights (its slots only)


@dataclass
class _Commands:
    adds: dict[int, list[tuple]] = field(default_factory=dict)  # rank -> (request id, prompt ids, params, domain)
    aborts: dict[int, list[str]] = field(default_factory=dict)
    stop: bool = False


def apply_commands(core: EngineCore, rank: int, commands: _Commands, errors: list[tuple[str, str]]) -> list[RequestOutput]:
    outputs = []
    for request_id, prompt_ids, params, domain in commands.adds.get(rank, ()):
        try:
            core.add_request(request_id, prompt_ids, params, domain)
        except LocusError as exc:
            errors.append((request_id, str(exc)))
    for request_id in commands.aborts.get(rank, ()):
        out = core.abort(request_id)
        if out is not None:
            outputs.append(out)
    return outputs


def iterate(core: EngineCore, ctx: EPContext, commands: _Commands | None) -> list[RankReport | None] | None:
    """One iteration on any rank (see the module doc); rank 0 passes its commands and gets every
    rank's report, the others pass None and get a list of Nones. None: rank 0 said stop."""
    rank, control = ctx.groups.rank, ctx.groups.control
    start = time.perf_counter()
    box = [commands]
    dist.broadcast_object_list(box, src=0, group=control)
    commands = box[0]
    if commands.stop:
        return None
    control_s = time.perf_counter() - start
    errors: list[tuple[str, str]] = []
    outputs = apply_commands(core, rank, commands, errors)
    agreed = ctx.agree_s
    stepped = ctx.any_rank(core.has_unfinished())
    if stepped:
        outputs += core.step()
    control_s += ctx.agree_s - agreed
    times = ctx.times
    if stepped:
        times.steps += 1
        times.step_s += time.perf_counter() - start
        times.control_s += control_s
    times.exchange_s = ctx.exchange.counters.exchange_s
    held = ctx.memory.held_bytes if ctx.memory is not None else 0
    report = RankReport(outputs, errors, core.stats(), ctx.exchange.counters, times, held)
    world = dist.get_world_size(control)
    gathered = [None] * world if rank == 0 else None
    gather_start = time.perf_counter()
    dist.gather_object(report, gathered, dst=0, group=control)
    if stepped:
        waited = time.perf_counter() - gather_start
        times.step_s += waited
        times.control_s += waited
    return gathered if rank == 0 else [None] * world


def serve_rank(core: EngineCore, ctx: EPContext) -> None:
    """A non-zero rank: iterate until rank 0 says stop (or a collective fails, which raises); then
    write its part of a recorded trace and tell rank 0 it is done."""
    while iterate(core, ctx, None) is not None:
        pass
    if core.recorder is not None:
        core.dump_recording()
    dist.barrier(group=ctx.groups.control)


class EPDriver:
    """Rank 0's side: AsyncEngine hands it adds and aborts, and calls `step` from its thread."""

    def __init__(self, core: EngineCore, ctx: EPContext):
        self.core, self.ctx = core, ctx
        plan = ctx.plan
        # the plan's grouper when it has one (no cost model: it never moves a request); else balanced
        self.grouper = Grouper(plan.topology, spec_of(plan)) if plan is not None and plan.grouping else None
        self.world = dist.get_world_size(ctx.groups.control)
        self._pending = _Commands()
        self._owner: dict[str, int] = {}  # request id -> rank, while unfinished
        self._in_flight = [0] * self.world  # tokens charged to each rank
        self._charge: dict[str, int] = {}
        self.stats: list[EngineStats | None] = [None] * self.world
        self.counters: list[ExchangeCounters] = [ExchangeCounters() for _ in range(self.world)]
        self.times: list[StepTimes] = [StepTimes() for _ in range(self.world)]
        self.expert_bytes: list[int] = [0] * self.world
        self.errors: list[tuple[str, str]] = []  # refused adds, for AsyncEngine to deliver

    @property
    def assignment(self) -> str:
        return "balanced" if self.grouper is None else "grouper"

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, domain: str | None) -> int:
        charge = len(prompt_ids) + (params.max_tokens or 0) * params.n
        if self.grouper is not None:
            rank = self.grouper.admit(request_id, domain, charge, prompt_tokens=len(prompt_ids))
        else:
            rank = min(range(self.world), key=lambda r: (self._in_flight[r], r))
        self._owner[request_id], self._charge[request_id] = rank, charge
        self._in_flight[rank] += charge
        self._pending.adds.setdefault(rank, []).append((request_id, prompt_ids, params, domain))
        return rank

    def abort(self, request_id: str) -> None:
        rank = self._owner.get(request_id)
        if rank is not None:
            self._pending.aborts.setdefault(rank, []).append(request_id)

    def requests(self) -> list[str]:
        """The unfinished requests, on any rank."""
        return list(self._owner)

    def has_unfinished(self) -> bool:
        return bool(self._owner) or bool(self._pending.adds)

    def step(self) -> list[RequestOutput]:
        """One iteration of every rank; the outputs of all of them."""
        commands, self._pending = self._pending, _Commands()
        reports = iterate(self.core, self.ctx, commands)
        outputs = []
        for rank, report in enumerate(reports):
            self.stats[rank], self.counters[rank], self.times[rank] = report.stats, report.counters, report.times
            self.expert_bytes[rank] = report.expert_bytes
            for request_id, message in report.errors:
                self._release(request_id)
                self.errors.append((request_id, message))
            for out in report.outputs:
                if out.finished:
                    self._release(out.request_id)
                outputs.append(out)
        return outputs

    def stop(self) -> None:
        """Tell every other rank to leave its loop (a last broadcast), and wait until each has
        finished its own shutdown work (writing its part of a recorded trace)."""
        dist.broadcast_object_list([_Commands(stop=True)], src=0, group=self.ctx.groups.control)
        dist.barrier(group=self.ctx.groups.control)

    def rank_tokens(self, rank: int) -> int:
        """Tokens `rank` ran through the MoE layers (its exchange counts each token once per layer)."""
        return self.counters[rank].token_layers // max(1, len(self.ctx.layers))

    def total_stats(self) -> EngineStats:
        """Counters summed over ranks (a rank not heard from yet counts as empty)."""
        known = [s for s in self.stats if s is not None] or [self.core.stats()]
        fields = EngineStats.__dataclass_fields__
        summed = {name: sum(getattr(s, name) for s in known) for name in fields}
        summed["kv_usage"] = 1.0 - summed["num_free_blocks"] / max(1, summed["num_blocks"])
        return EngineStats(**summed)

    def _release(self, request_id: str) -> None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._in_flight[rank] -= self._charge.pop(request_id, 0)
            if self.grouper is not None:
                self.grouper.finish(request_id)
