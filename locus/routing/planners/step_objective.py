"""The step-time objective (`locus plan --hardware PROFILE`, `--objective step-time`): of the plans the
planner can make for a trace, the one whose predicted decode step is shortest on that hardware.

Bytes under fixed caps are a proxy: in lockstep expert parallelism the slowest rank's attention and
expert time and the exchange together set every step (replay/step_time.py). So the objective plans
each candidate, replays it through the step-time model and keeps the fastest:

  candidates   EPLB (balanced assignment: the status quo, so the pick is never slower than it on the
               data it is scored on); the locality plan at the given caps with each replica budget
               (`top`: each node's most used experts; `marginal`: a replica only where it saves more
               than it costs); the locality plan at a tighter expert cap (the given cap's slack
               halved: less expert imbalance, more bytes); the locality placement without its grouping
               (balanced assignment: fewer bytes from placement alone, no admission imbalance)
  scoring      plan each on the first SCORE_SPLIT of the planning requests, replay the rest (at most
               SCORE_REQUESTS of them) in the decode step order with `concurrency` requests in flight,
               requests admitted as a live server admits them (the plan's grouper, a closed-loop
               client; balanced assignment without a grouping); the figure is the predicted TPOT p50,
               then p99, then inter-node bytes per token (ties)
  result       the winner's settings planned on every planning request; its provenance names the
               objective, the profile and every candidate's figures

Scoring on requests the candidates were not planned on keeps a plan that fits its own data closely
from winning on that alone (docs/planner.md, "The step-time objective").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from locus.errors import LocusError
from locus.routing.grouping.live import simulate_live
from locus.routing.plan.topology import Topology
from locus.routing.planners.planner import PlanOptions, PlanResult, make_plan
from locus.routing.replay.assignment import assign_balanced
from locus.routing.replay.hardware import HardwareProfile
from locus.routing.replay.model_shape import ModelShape
from locus.routing.replay.simulator import replay

OBJECTIVES = ("step-time", "bytes")
SCORE_SPLIT = 0.75  # candidates plan on this share of the planning requests and are scored on the rest
SCORE_REQUESTS = 2000  # at most this many scoring requests (the last of the rest): bounds the replays' time
MIN_SCORE_REQUESTS = 8

Log = Callable[[str], None]


@dataclass(frozen=True)
class StepObjective:
    hardware: HardwareProfile
    model_shape: ModelShape
    concurrency: int  # requests in flight while scoring (decode step order and the grouper's client)


@dataclass(frozen=True)
class Candidate:
    label: str
    planner: str  # "eplb" or "locality"
    options: PlanOptions
    grouped: bool  # admitted by the plan's grouper (else balanced assignment, the grouping dropped)


@dataclass
class Score:
    label: str
    tpot_p50_ms: float
    tpot_p99_ms: float
    inter_node_bytes_per_token: float
    attention_imbalance: float
    expert_imbalance_worst: float

    def key(self) -> tuple[float, float, float]:
        return (self.tpot_p50_ms, self.tpot_p99_ms, self.inter_node_bytes_per_token)


@dataclass
class StepTimePlan:
    result: PlanResult  # the winner, planned on every planning request
    chosen: str
    scores: list[Score]
    scored_on: tuple[int, int]  # the scoring requests


def candidates(options: PlanOptions) -> list[Candidate]:
    """What the objective compares (module docstring), for the user's `options`."""
    cap = options.caps.expert
    tighter = 1.0 + (cap - 1.0) / 2
    out = [Candidate("eplb", "eplb", dataclasses.replace(options, dispatch=None), grouped=False)]
    for budget in ("top", "marginal"):
        out.append(Candidate(f"locality, replica budget {budget}", "locality",
                             dataclasses.replace(options, replica_budget=budget), grouped=True))
    out.append(Candidate(f"locality, expert cap {tighter:.3f}", "locality",
                         dataclasses.replace(options, caps=dataclasses.replace(options.caps, expert=tighter)),
                         grouped=True))
    out.append(Candidate("locality placement only", "locality", options, grouped=False))
    return out


def plan_for_step_time(reader, topology: Topology, requests: tuple[int, int], options: PlanOptions,
                       objective: StepObjective, trace: str = "", log: Log = lambda _: None) -> StepTimePlan:
    """Plan every candidate on the start of `requests`, score it on the rest, plan the winner on all."""
    start, stop = requests
    split = start + int(round(SCORE_SPLIT * (stop - start)))
    if stop - split < MIN_SCORE_REQUESTS or split <= start:
        raise LocusError(f"the step-time objective scores plans on the last {100 * (1 - SCORE_SPLIT):.0f} % of the "
                         f"planning requests: {start}:{stop} leaves {stop - split}, fewer than {MIN_SCORE_REQUESTS}; "
                         "plan on more requests or use --objective bytes")
    objective.model_shape.check_trace(reader.meta)
    score_range = (max(split, stop - SCORE_REQUESTS), stop)
    scores: list[Score] = []
    made: dict[tuple, PlanResult] = {}
    for cand in candidates(options):
        key = (cand.planner, cand.options)
        if key not in made:  # the placement-only candidate reuses the grouped plan of the same options
            made[key] = make_plan(cand.planner, reader, topology, (start, split), cand.options, trace=trace)
        score = _score(reader, made[key].plan, topology, score_range, cand, objective)
        scores.append(score)
        log(f"  {cand.label}: predicted TPOT {score.tpot_p50_ms:.3f} / {score.tpot_p99_ms:.3f} ms (p50 / p99), "
            f"{score.inter_node_bytes_per_token:,.0f} inter-node B/token")
    best = min(range(len(scores)), key=lambda i: scores[i].key())
    winner = candidates(options)[best]
    result = make_plan(winner.planner, reader, topology, requests, winner.options, trace=trace)
    if not winner.grouped:
        result.plan.grouping = None
    result.plan.provenance.update(
        objective="step-time", hardware=objective.hardware.name, model_shape=objective.model_shape.name,
        concurrency=objective.concurrency, chosen=winner.label, scored_on=f"{score_range[0]}:{score_range[1]}",
        candidates=[dataclasses.asdict(s) for s in scores])
    return StepTimePlan(result, winner.label, scores, score_range)


def _score(reader, plan, topology: Topology, score_range: tuple[int, int], cand: Candidate,
           objective: StepObjective) -> Score:
    lo, hi = score_range
    if cand.grouped:
        assignment = simulate_live(plan, reader, lo, hi, arrivals="closed", concurrency=objective.concurrency).assignment
    else:
        assignment = assign_balanced([r.tokens for r in reader.requests[lo:hi]], topology.ranks, request_start=lo)
    report = replay(reader, plan, topology, assignment, step_order="decode", concurrency=objective.concurrency,
                    hardware=objective.hardware, model_shape=objective.model_shape)
    t = report.step_time
    return Score(cand.label, t["tpot_p50_ms"], t["tpot_p99_ms"], report.inter_node_bytes_per_token,
                 report.attention_imbalance, report.expert_imbalance_worst)


def format_scores(plan: StepTimePlan) -> str:
    lines = [f"step-time objective: candidates planned on the first {100 * SCORE_SPLIT:.0f} % of the planning "
             f"requests, scored on {plan.scored_on[0]}:{plan.scored_on[1]}",
             "| candidate | predicted TPOT p50 / p99 ms | inter-node B/token | attention imb. | expert imb. worst |",
             "|---|---|---|---|---|"]
    for s in plan.scores:
        mark = " (chosen)" if s.label == plan.chosen else ""
        lines.append(f"| {s.label}{mark} | {s.tpot_p50_ms:.3f} / {s.tpot_p99_ms:.3f} | "
                     f"{s.inter_node_bytes_per_token:,.0f} | {s.attention_imbalance:.3f} | {s.expert_imbalance_worst:.3f} |")
    return "\n".join(lines)
