"""Placement planners: `round_robin`, `eplb` (the baselines, baselines.py) and `locality`, Locus's own.

    make_plan(name, reader, topology, (start, stop), options) -> PlanResult(plan, summary)

locality chooses three things together, from the planning requests' expert signatures:
  1. grouping: which node each request runs on. Requests with a domain tag are spread over their
     domain's nodes (domains laid end to end over the nodes by token share, grouping_spec.py, in the
     order that puts domains using the same experts on the same nodes, domain_layout.py);
     untagged requests are clustered by signature into token-balanced groups (request_clustering.py).
  2. placement, layer by layer (locality.py): every node holds the experts its group uses most,
     hot domain-generic experts on every node, the cold tail where it costs least; then node loads
     are balanced, replicas packed on GPUs, and a local search enforces the expert-load cap.
     The grouping is shared by all layers, so a request keeps its experts close in every layer.
  3. the online grouper's view (grouper.py): the plan is handed to the grouper, which is run over the
     planning requests exactly as it would run online (domain tag at admission, prefill signature
     after prefill, moves only when they pay); its grouping is the next round's demand. Of the rounds,
     the plan with the lowest expected inter-node bytes on its own grouping wins.
Hard constraints: exact slot counts (by construction), every expert placed (validated), expert-load
imbalance <= caps.expert on the planning grouping (a layer the search cannot bring under the cap
takes EPLB's placement if that meets it; else an error), attention imbalance <= caps.attention for
the grouper. Deterministic: ties break by index; the seed drives only the clustering of untagged
requests.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import numpy as np

from locus.errors import LocusError
from locus.routing.dispatch_rule import DEFAULT_RULE, planner_rule
from locus.routing.replay.assignment import Assignment, assign_balanced
from locus.routing.planners.baselines import eplb, round_robin
from locus.routing.planners.domain_layout import domain_orders
from locus.routing.plan.caps import Caps
from locus.routing.grouping.grouper import Grouper
from locus.routing.plan.predictor import DEFAULT_TOKENS, DEFAULT_TOP_EXPERTS, TokenAffinity
from locus.routing.grouping.simulation import chunk_bounds, run_grouper, signature_chunks
from locus.routing.plan.grouping_spec import GroupingSpec, domain_node_weights, kv_bytes_per_token, normalise_rows
from locus.routing.planners.dispatch_pull import RoutingSample, measure_pull, sample_routings
from locus.routing.planners.expected_load import rank_loads
from locus.routing.planners.layer_caps import layer_caps
from locus.routing.planners.layer_pool import LayerPool, pool_workers
from locus.routing.planners.locality import BUDGETS
from locus.routing.planners.group_alignment import place_aligned
from locus.routing.expert_groups import ExpertGroups
from locus.routing.plan.placement import PlacementPlan, validate
from locus.routing.replay.simulator import count_expert_loads
from locus.routing.planners.summary import (PlanSummary, attention_imbalance, demand_figures, eplb_bytes_per_token,
                                        expected_bytes_per_token)
from locus.routing.planners.request_clustering import balanced_clusters, signature_features
from locus.routing.grouping.signatures import RequestSignatures, collect_signatures, group_demand
from locus.routing.plan.topology import Topology
from locus.traces.metrics import max_over_mean

PLANNERS = ("round_robin", "eplb", "locality")
LOAD_MODELS = ("dispatch", "even")  # PlanOptions.load_model
CALIBRATIONS = 4  # locality, node-aware: cap searches under a measured pull (_calibrate)


@dataclass(frozen=True)
class PlanOptions:
    caps: Caps = field(default_factory=Caps)
    seed: int = 0
    expert_groups: int | None = None  # eplb: hierarchical policy over this many expert groups
    rounds: int = 2  # locality: placement <-> grouper rounds
    kv_bytes_per_token: int | None = None  # default: the trace's, else grouping_spec.kv_bytes_per_token
    dispatch: str | None = None  # the dispatch rule the plan names (default dispatch_rule.planner_rule: eplb's
    # plans `position`, the others DEFAULT_RULE)
    replica_budget: str = "top"  # locality: "top" (each node's most used experts) or "marginal" (replica_budget.py)
    # locality: the expected-load model the cap search balances. "dispatch": the plan's dispatch rule (under
    # node-aware, remote pairs split as a routed sample of the planning requests shows, dispatch_pull.py);
    # "even": the `position` rule's even spread over replicas (exact under `position`). None: load_model_for(budget).
    load_model: str | None = None
    # locality: the prompt predictor stored with the plan (grouping.predictor), learned from the planning
    # rows' token ids when the trace has them: at most this many token ids (0: none), each with its
    # `predictor_experts` largest expert shares per layer
    predictor_tokens: int = DEFAULT_TOKENS
    predictor_experts: int = DEFAULT_TOP_EXPERTS
    # locality: plan each layer at the larger of caps.expert (then a floor) and EPLB's figure on it, instead of
    # failing where the cap cannot be met (`--expert-cap auto`, layer_caps.py)
    expert_cap_auto: bool = False
    # locality: `--expert-cap eplb[:SHARE]`: each layer searched at EPLB's figure with this share of its slack
    # over 1.0 (at most caps.expert), settled as auto (layer_caps.py); for plans a live server admits by
    expert_cap_eplb_share: float | None = None
    # locality: keep every replica of each expert group on one node (`--align-groups`, group_alignment.py)
    align_groups: ExpertGroups | None = None
    # locality: worker processes placing a round's layers side by side (layer_pool.py; 1: in this process).
    # None: the CPUs this process may use, or 1 for a small plan. The plan is the same for any count.
    workers: int | None = None

    def __post_init__(self):
        # checked where the options are made, for the CLI and API callers alike, before any work
        if self.workers is not None and self.workers < 1:
            raise LocusError(f"--workers must be at least 1, got {self.workers}")


@dataclass
class PlanResult:
    plan: PlacementPlan
    summary: PlanSummary
    assignment: Assignment  # the planning requests' grouping the figures are for


def make_plan(name: str, reader, topology: Topology, requests: tuple[int, int],
              options: PlanOptions = PlanOptions(), trace: str = "") -> PlanResult:
    """Plan on requests [start, stop) of `reader`. plan_seconds counts what the planner needs to make
    the plan (reading the trace included), not the summary figures computed afterwards."""
    if name not in PLANNERS:
        raise LocusError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    meta = reader.meta
    topology.check_fits(meta.num_experts)
    start, stop = requests
    if stop <= start:
        raise LocusError(f"planning range {start}:{stop} holds no requests")
    t0 = time.perf_counter()
    if name == "locality":
        if load_model_for(options) not in LOAD_MODELS:
            raise LocusError(f"unknown load model {options.load_model!r}; choose one of {', '.join(LOAD_MODELS)}")
        signatures = _signatures(reader, start, stop)
        sample = None
        if _needs_pull(options, meta.top_k, topology):
            sample = sample_routings(reader, start, stop)
        predictor = None
        if options.predictor_tokens > 0 and reader.token_ids is not None and meta.vocab_size is not None:
            predictor = TokenAffinity.learn(reader, start, stop, options.predictor_tokens, options.predictor_experts)
        result = _locality(meta, signatures, topology, options, t0, sample, predictor)
    else:
        result = _baseline(name, reader, meta, topology, (start, stop), options, t0)
    result.plan.dispatch = planner_rule(name, options.dispatch)
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result.plan.provenance.update(
        planner=name, trace=str(trace), requests=f"{start}:{stop}", created=created, seed=options.seed,
        caps=options.caps.to_dict(), plan_seconds=round(result.summary.plan_seconds, 3),
        planning_locality=round(result.summary.locality, 5),
        planning_expert_imbalance=round(result.summary.expert_imbalance_worst, 5),
    )
    validate(result.plan, num_experts=meta.num_experts, moe_layers=meta.moe_layers)
    return result


def _signatures(reader, start: int, stop: int) -> RequestSignatures:
    signatures = collect_signatures(reader, start, stop)
    if signatures.tokens.sum() == 0:
        raise LocusError(f"planning requests {start}:{stop} hold no tokens")
    return signatures


def _baseline(name, reader, meta, topology: Topology, requests, options: PlanOptions, t0: float) -> PlanResult:
    if name == "round_robin":
        plan = round_robin(meta.num_experts, meta.moe_layers, topology, model=meta.model)
    else:
        loads = count_expert_loads(reader, *requests)  # [L, E]
        plan = eplb(loads, meta.moe_layers, topology, groups=options.expert_groups, model=meta.model)
    seconds = time.perf_counter() - t0
    sig = _signatures(reader, *requests)
    assignment = assign_balanced(sig.tokens, topology.ranks, request_start=sig.start)
    node = assignment.ranks // topology.gpus_per_node
    summary = _summary(name, meta, plan, _spec(meta, sig, topology, options), sig, topology, assignment, node, node,
                       "balanced assignment")
    summary.plan_seconds = seconds
    return PlanResult(plan, summary, assignment)


def load_model_for(options: PlanOptions) -> str:
    """The load model a locality plan is made with: the caller's, else "dispatch" for the marginal budget
    (whose plans hold hot experts on few nodes, where the node-aware rule's uneven remote split decides the
    balance) and "even" for the top budget (measured on the presets: the same replayed balance and bytes
    either way, for half again the plan time; docs/planner.md)."""
    if options.load_model is not None:
        return options.load_model
    return "dispatch" if options.replica_budget == "marginal" else "even"


def _needs_pull(options: PlanOptions, top_k: int, topology: Topology) -> bool:
    """Whether the load model must measure the node-aware rule's remote split: the rules differ only with
    top-k > 1 and three or more nodes (docs/replay.md)."""
    if options.align_groups is not None:  # every expert on one node: both rules route alike
        return False
    rule = options.dispatch or DEFAULT_RULE
    return load_model_for(options) == "dispatch" and rule == "node-aware" and top_k > 1 and topology.nodes > 2


def _locality(meta, sig: RequestSignatures, topology: Topology, options: PlanOptions, t0: float,
              sample: RoutingSample | None = None, predictor: TokenAffinity | None = None) -> PlanResult:
    shape = (len(meta.moe_layers), topology.nodes, meta.num_experts)
    with LayerPool(shape, pool_workers(options.workers, shape[0], topology.ranks, meta.num_experts), sig) as pool:
        return _locality_rounds(meta, sig, topology, options, t0, sample, predictor, pool)


def _locality_rounds(meta, sig: RequestSignatures, topology: Topology, options: PlanOptions, t0: float,
                     sample: RoutingSample | None, predictor: TokenAffinity | None, pool: LayerPool) -> PlanResult:
    N, G = topology.nodes, topology.gpus_per_node
    spec, prefill_node, decode_node, placed = _domain_layout(meta, sig, topology, options, pool)
    spec.predictor = predictor
    best = None
    rounds = max(1, options.rounds)
    for k in range(rounds):
        if k == 0 and placed is not None:  # the layout's choice already placed this grouping
            demand, slots, fallback, caps = placed
        else:
            demand = group_demand(sig, prefill_node, decode_node, N)  # [L, N, E]
            slots, fallback, caps = _place(demand, meta, topology, options, pool)
        pull = None
        if sample is not None:
            slots, pull = _calibrate(slots, demand, meta, topology, caps, fallback, sample, prefill_node, decode_node,
                                     pool)
        plan = PlacementPlan(meta.model, meta.num_experts, tuple(meta.moe_layers), topology, slots,
                             grouping=spec.to_dict(), provenance={"planner": "locality"})
        score = expected_bytes_per_token(plan, spec, sig, prefill_node, decode_node, meta.moe_layers, pool)
        if best is None or score < best[0]:
            best = (score, plan, demand, fallback, prefill_node, decode_node, pull, caps)
        if k + 1 < rounds:  # the grouper's online grouping under this plan is the next round's demand
            assignment = _simulate(plan, sig, meta, pool)
            prefill_node, decode_node = assignment.ranks // G, _decode_ranks(assignment) // G
    score, plan, demand, fallback, prefill_node, decode_node, pull, caps = best
    seconds = time.perf_counter() - t0
    # The figures are for the grouping this plan was placed for; the replay will show the online one.
    ranks = _ranks_for_nodes(sig, prefill_node, decode_node, topology)
    summary = _summary("locality", meta, plan, spec, sig, topology, ranks, prefill_node, decode_node,
                       "domain tag + grouper" if any(sig.domains) else "signature clusters + grouper",
                       demand=demand, fallback=fallback, bytes_per_token=score, pull=pull)
    summary.eplb_inter_node_bytes_per_token = eplb_bytes_per_token(meta, spec, sig, topology, pool)
    summary.plan_seconds = seconds
    if options.expert_cap_eplb_share is not None:  # what the eplb mode chose, per MoE layer in plan order
        summary.expert_caps = {"share": float(options.expert_cap_eplb_share), "ceiling": float(options.caps.expert),
                               "layers": [round(float(c), 5) for c in caps]}
        plan.provenance["expert_cap_eplb"] = summary.expert_caps
    elif options.expert_cap_auto:  # what auto chose, per MoE layer in plan order
        summary.expert_caps = {"floor": float(options.caps.expert), "layers": [round(float(c), 5) for c in caps]}
        plan.provenance["expert_cap_auto"] = summary.expert_caps
    plan.grouping["extra"] = {"planning_locality": round(summary.locality, 5)}
    return PlanResult(plan, summary, ranks)


def _domain_layout(meta, sig: RequestSignatures, topology: Topology, options: PlanOptions, pool: LayerPool):
    """The grouping spec and first-round nodes of the domain order that places best: the size order and the
    orders domain_layout.py scores lowest, each sketched (_sketch: the placement before the cap search) on its
    own grouping and scored by expected inter-node bytes, as the rounds are; ties keep the earlier (the size
    order first). The last item is None (the first round places the chosen order itself) but under the eplb
    mode below (the chosen order's placement: demand, slots, fallback layers, caps). The cap
    search is most of a placement's time at a few slots per GPU, and it moves replicas for balance, which
    costs every layout some locality, so the layouts are compared before it. Not under `--expert-cap eplb`:
    there the caps sit below EPLB's figure and the search costs the layouts very unequal shares of their
    locality (the sketch's best can end the worst), so each layout is placed in full and the chosen one's
    placement is the first round's."""
    orders = domain_orders(sig.domains, sig.tokens, sig.domain_pairs(), topology.nodes,
                           topology.gpus_per_node * topology.slots_per_gpu, LAYOUT_CANDIDATES)
    best = None
    for order in orders:
        spec = _spec(meta, sig, topology, options, order)
        prefill_node, decode_node = _initial_grouping(sig, topology, spec, options.seed)
        placed = None
        if len(orders) > 1:
            demand = group_demand(sig, prefill_node, decode_node, topology.nodes)
            if options.expert_cap_eplb_share is not None:
                placed = (demand, *_place(demand, meta, topology, options, pool))
                slots = placed[1]
            else:
                slots = _sketch(demand, meta, topology, options, pool)
            plan = PlacementPlan(meta.model, meta.num_experts, tuple(meta.moe_layers), topology, slots,
                                 grouping=spec.to_dict(), provenance={"planner": "locality"})
            score = expected_bytes_per_token(plan, spec, sig, prefill_node, decode_node, meta.moe_layers, pool)
        else:
            score = 0.0
        if best is None or score < best[0]:
            best = (score, spec, prefill_node, decode_node, placed)
    return best[1:]


def _spec(meta, sig: RequestSignatures, topology: Topology, options: PlanOptions,
          order: list[str] | None = None) -> GroupingSpec:
    decode = sig.tokens - sig.prompt_tokens
    # what the recording engine's cache held per token, where the trace says, before a name table or formula
    kv = (options.kv_bytes_per_token or meta.kv_bytes_per_token
          or kv_bytes_per_token(meta.model, meta.hidden_size, meta.dtype_bytes, meta.moe_layers))
    return GroupingSpec(
        domain_nodes=domain_node_weights(sig.domains, sig.tokens, topology.nodes, order=order),
        caps=options.caps,
        expected_decode_tokens=float(decode.mean()) if len(decode) else 0.0,
        kv_bytes_per_token=int(kv),
        bytes_per_send=2 * meta.hidden_size * meta.dtype_bytes,
        top_k=meta.top_k,
        expert_prior=normalise_rows(sig.all_pairs()),
    )


def _initial_grouping(sig: RequestSignatures, topology: Topology, spec: GroupingSpec, seed: int):
    """Nodes [R] of the first round: the grouper's admission (domain tags), untagged requests by cluster."""
    grouper = Grouper(topology, spec, cost=None)
    assignment = run_grouper(grouper, sig.ids, sig.domains, sig.tokens, sig.prompt_tokens,
                             signature_chunks(sig.prefill))
    node = assignment.ranks // topology.gpus_per_node
    untagged = np.flatnonzero([not d or d not in spec.domain_nodes for d in sig.domains])
    if len(untagged) > topology.nodes:
        features = signature_features(sig.total_rows(untagged), seed)
        node[untagged] = balanced_clusters(features, sig.tokens[untagged], topology.nodes, seed)
    return node, node.copy()


LAYOUT_CANDIDATES = 3  # domain orders placed and scored: the size order and the two best by affinity


def _place(demand: np.ndarray, meta, topology: Topology, options: PlanOptions, pool: LayerPool):
    """Slots [L, R, S] meeting each layer's expert cap on `demand`, the layers that took EPLB's placement, and
    the caps [L] (layer_caps.py). The layers EPLB misses are searched first: under a fixed cap, one the search
    misses too stops the plan there, before the other layers' searches; under auto, its cap is the best
    figure reached. The layers are placed in `pool`'s workers and settled in that order as they come back."""
    if options.replica_budget not in BUDGETS:
        raise LocusError(f"unknown replica budget {options.replica_budget!r}; choose one of {', '.join(BUDGETS)}")
    if options.align_groups is not None:
        if options.expert_cap_eplb_share is not None:
            raise LocusError("--expert-cap eplb is not taken with --align-groups: give a number or auto[:FLOOR]")
        return place_aligned(demand, meta.moe_layers, topology, options.align_groups, options.caps.expert,
                             options.expert_cap_auto)
    limits = layer_caps(demand, meta.moe_layers, topology, options.caps.expert, options.expert_cap_auto,
                        options.expert_cap_eplb_share)
    slots = np.empty_like(limits.eplb_slots)
    missed = []
    order = limits.search_order()
    placements = pool.place(demand, order, limits.caps.copy(), topology.gpus_per_node, topology.slots_per_gpu,
                            options.replica_budget, meta.top_k)
    for l, placed in zip(order, placements):
        if placed.met_cap or limits.settle(l, placed.imbalance):
            slots[l] = placed.slots
        else:
            slots[l] = limits.eplb_slots[l]
            missed.append(l)
    return slots, [int(meta.moe_layers[l]) for l in sorted(missed)], limits.caps


def _sketch(demand: np.ndarray, meta, topology: Topology, options: PlanOptions, pool: LayerPool) -> np.ndarray:
    """Slots [L, R, S] of each layer's placement before the cap search (locality.sketch_layer), to compare
    domain layouts; with --align-groups, _place itself."""
    if options.align_groups is not None:
        return _place(demand, meta, topology, options, pool)[0]
    if options.replica_budget not in BUDGETS:
        raise LocusError(f"unknown replica budget {options.replica_budget!r}; choose one of {', '.join(BUDGETS)}")
    return pool.sketch(demand, options.caps.expert, topology.gpus_per_node, topology.slots_per_gpu,
                       options.replica_budget, meta.top_k)


def _calibrate(slots: np.ndarray, demand: np.ndarray, meta, topology: Topology, caps: np.ndarray, fallback: list[int],
               sample: RoutingSample, prefill_node: np.ndarray, decode_node: np.ndarray, pool: LayerPool):
    """The cap under the node-aware rule: measure where the rule sends remote pairs with the current slots
    (dispatch_pull.measure_pull, the rule itself on a sample of the planning requests), re-run the cap
    search under that split on the layers it puts over the cap, and measure those layers again, up to
    CALIBRATIONS times. Each layer keeps the slots with the lowest measured imbalance (the first ones met
    the cap under the even spread). EPLB fallback layers are left as they are. Returns (slots [L, R, S],
    the pull measured for the returned slots [L, N, E, N]). The re-searches of a step run in `pool`'s workers."""
    L = demand.shape[0]
    G = topology.gpus_per_node
    slots = slots.copy()
    keep = np.array([meta.moe_layers[l] not in fallback for l in range(L)])
    best_slots, best_imb = slots.copy(), np.full(L, np.inf)
    best_pull = None
    todo = np.arange(L)  # layers to measure
    for k in range(CALIBRATIONS + 1):
        plan = PlacementPlan(meta.model, meta.num_experts, tuple(meta.moe_layers), topology, slots)
        pull = measure_pull(plan, sample, prefill_node, decode_node, todo)  # [len(todo), N, E, N]
        if best_pull is None:
            best_pull = pull
        imb = max_over_mean(rank_loads(slots[todo], demand[todo], pull))
        better = imb < best_imb[todo]
        best_slots[todo[better]], best_imb[todo[better]] = slots[todo[better]], imb[better]
        best_pull[todo[better]] = pull[better]
        over = keep[todo] & (imb > caps[todo])
        if k == CALIBRATIONS or not over.any():
            break
        searches = []
        for i in np.flatnonzero(over):  # from the current slots, under their own split
            l = todo[i]
            target = caps[l] * float(demand[l].sum()) / topology.ranks * (1 - 1e-9)
            searches.append((l, slots[l], target, pull[i]))
        for (l, *_), searched in zip(searches, list(pool.enforce(demand, searches, G))):
            slots[l] = searched
        todo = todo[over]
    return best_slots, best_pull


def _simulate(plan: PlacementPlan, sig: RequestSignatures, meta, pool: LayerPool) -> Assignment:
    """The grouper run over the planning requests under `plan`; its per-chunk cost scores in `pool`'s workers
    (they depend on the plan only, not on the grouper's state)."""
    grouper = Grouper.from_plan(plan, moe_layers=meta.moe_layers)
    chunk_bytes = None
    if grouper.cost is not None and grouper.moves:
        chunk_bytes = pool.chunk_bytes(grouper.cost, sig, chunk_bounds(sig.num_requests))
    return run_grouper(grouper, sig.ids, sig.domains, sig.tokens, sig.prompt_tokens, signature_chunks(sig.prefill),
                       request_start=sig.start, chunk_bytes=chunk_bytes)


def _decode_ranks(assignment: Assignment) -> np.ndarray:
    return assignment.ranks if assignment.decode_ranks is None else assignment.decode_ranks


def _ranks_for_nodes(sig: RequestSignatures, prefill_node, decode_node, topology: Topology) -> Assignment:
    """A rank per request on its node, least-loaded first (the grouper's rule), for the attention figure."""
    R, gpus = sig.num_requests, topology.gpus_per_node
    loads = np.zeros(topology.ranks)
    ranks, decode = np.empty(R, dtype=np.int64), np.empty(R, dtype=np.int64)
    prompt, rest = sig.prompt_tokens, sig.tokens - sig.prompt_tokens
    for i in range(R):
        lo = prefill_node[i] * gpus
        ranks[i] = lo + int(np.argmin(loads[lo : lo + gpus]))
        loads[ranks[i]] += prompt[i]
        if decode_node[i] == prefill_node[i]:
            decode[i] = ranks[i]
        else:
            lo = decode_node[i] * gpus
            decode[i] = lo + int(np.argmin(loads[lo : lo + gpus]))
        loads[decode[i]] += rest[i]
    moved = decode != ranks
    return Assignment("planning grouping", sig.start, ranks, decode if moved.any() else None)


def _summary(name, meta, plan, spec, sig, topology, assignment, prefill_node, decode_node, grouping,
             demand=None, fallback=(), bytes_per_token=None, pull=None) -> PlanSummary:
    if demand is None:
        demand = group_demand(sig, prefill_node, decode_node, topology.nodes)
    locality, imb_mean, imb_worst = demand_figures(np.asarray(plan.slots), demand, pull)
    if bytes_per_token is None:
        bytes_per_token = expected_bytes_per_token(plan, spec, sig, prefill_node, decode_node, meta.moe_layers)
    attn = attention_imbalance(sig.tokens, assignment.ranks, _decode_ranks(assignment), sig.prompt_tokens,
                               topology.ranks)
    return PlanSummary(
        planner=name, model=meta.model, topology=f"{topology.nodes}x{topology.gpus_per_node}",
        slots_per_gpu=topology.slots_per_gpu, requests=(sig.start, sig.start + sig.num_requests),
        tokens=int(sig.tokens.sum()), locality=locality, inter_node_bytes_per_token=float(bytes_per_token),
        expert_imbalance_mean=imb_mean, expert_imbalance_worst=imb_worst, attention_imbalance=attn,
        plan_seconds=0.0, grouping=grouping, fallback_layers=list(fallback),
    )
