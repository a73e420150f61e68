"""Replay: what a placement plan and a request assignment would cost on a recorded trace.

    reader (TraceReader or anything with .meta, .requests, .offsets, .expert_ids [N, L, K])
      -> rows of the assigned request range, in trace order, in chunks
      -> dispatch rule (the serving runtime's own) -> TrafficMeter -> ReplayReport

Step orders (whole-replay figures do not depend on it; per-step figures do):
  trace  the rows of the assignment's request range in trace order; a step is `batch_tokens`
         consecutive rows (docs/design.md's definition). A step then holds a few whole requests, so it
         sees only the ranks those requests run on.
  ranks  what a DP-attention deployment runs: each rank works through its own queue (its requests'
         rows, in trace order), and step j takes the next c = max(1, batch_tokens // R) rows of
         every rank's queue (fewer once a queue runs dry). Needs 40 bytes of index per replayed row.
  decode what continuous batching runs in decode: a closed-loop client keeps `concurrency` requests in
         flight, in trace order, each on its assigned rank; a request admitted at step a runs its prompt
         rows in step a and its i-th decode row in step a + 1 + i, and the next request is admitted in
         the step after its last. So a step holds the next decode row of every request in flight (plus
         the prompts of those just admitted). batch_tokens plays no part. 40 bytes of index a row.
With a hardware profile and a model shape the replay also predicts every step's time (step_time.py).
Plan on one part of a trace and replay another: figures measured on the planning data itself are not
results.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Callable

import numpy as np

from locus.errors import LocusError
from locus.kernels.formats import PAYLOAD_FORMATS, payload_row_bytes
from locus.routing.replay.assignment import Assignment
from locus.routing.dispatch_rule import build_dispatch_table
from locus.routing.plan.placement import PlacementPlan, validate
from locus.routing.replay.hardware import HardwareProfile
from locus.routing.replay.metrics import LinkModel, PairSink, TrafficMeter
from locus.routing.replay.model_shape import ModelShape
from locus.routing.replay.report import ReplayReport
from locus.routing.replay.step_time import StepTimeModel
from locus.routing.plan.topology import Topology
from locus.traces.counts import count_expert_ids
from locus.traces.reader import CHUNK_ROUTINGS


Progress = Callable[[int, int], None]  # (rows done, rows total)
STEP_ORDERS = ("trace", "ranks", "decode")


def parse_request_range(spec: str | None, num_requests: int) -> tuple[int, int]:
    """"START:STOP" -> [start, stop) request indices; either side may be empty.

    If either bound has a '.', both are fractions of the request count, rounded down (floor(f * R), so
    "0:0.5" and "0.5:1" split a trace exactly); otherwise they are indices (negative ones count from
    the end, like Python slices).
    """
    if spec is None or spec.strip() in ("", ":"):
        return 0, num_requests
    if spec.count(":") != 1:
        raise LocusError(f"request range {spec!r} is not of the form START:STOP (e.g. 0:0.5 or 100:200)")
    texts = [t.strip() for t in spec.split(":")]
    fractions = any("." in t for t in texts)

    def bound(text: str, default: int) -> int:
        if not text:
            return default
        try:
            value = float(text) if fractions else int(text)
        except ValueError:
            raise LocusError(f"request range {spec!r}: {text!r} is not a number") from None
        if fractions:
            if not 0.0 <= value <= 1.0:
                raise LocusError(f"request range {spec!r}: fraction {text} is outside 0..1")
            return int(np.floor(value * num_requests + 1e-9))
        return value + num_requests if value < 0 else value

    start, stop = bound(texts[0], 0), bound(texts[1], num_requests)
    if not 0 <= start <= stop <= num_requests:
        raise LocusError(f"request range {spec!r} gives {start}:{stop}, outside 0:{num_requests} or reversed")
    return start, stop


def count_expert_loads(reader, request_start: int, request_stop: int) -> np.ndarray:
    """Tokens routed to each expert per layer over a request range, [L, E] int64 (planner input)."""
    meta = reader.meta
    L, E = len(meta.moe_layers), meta.num_experts
    lo, hi = int(reader.offsets[request_start]), int(reader.offsets[request_stop])
    counts = np.zeros((L, E), dtype=np.int64)
    step = max(1, CHUNK_ROUTINGS // (L * meta.top_k))
    for a in range(lo, hi, step):
        counts += count_expert_ids(reader.expert_ids[a : min(a + step, hi)], E)
    return counts


def plan_in_trace_order(plan: PlacementPlan, moe_layers) -> PlacementPlan:
    """The plan with its layers in the trace's order (a plan may list them in any order)."""
    order = [plan.moe_layers.index(int(x)) for x in moe_layers]
    return dataclasses.replace(plan, moe_layers=tuple(int(x) for x in moe_layers), slots=np.asarray(plan.slots)[order])


def rank_step_order(offsets: np.ndarray, assignment: Assignment, num_ranks: int, batch_tokens: int,
                    prompt_tokens: np.ndarray | None = None):
    """Rows of the assignment's requests in the `ranks` step order, and the step of each: (rows, steps).

    A rank's queue is its rows in trace order (a request the grouper moved after prefill has its
    prompt rows in one queue and its decode rows in another). prompt_tokens [requests] is needed only
    when the assignment splits requests.
    """
    start, stop = assignment.request_start, assignment.request_stop
    rows = np.arange(offsets[start], offsets[stop])
    request = np.searchsorted(offsets, rows, side="right") - 1 - start
    row_rank = assignment.row_ranks(request, rows - offsets[start + request], prompt_tokens)
    # Where each row sits in its rank's queue: its index among the rows of the same rank.
    by_rank = np.argsort(row_rank, kind="stable")
    first = np.searchsorted(row_rank[by_rank], row_rank[by_rank], side="left")
    queue_pos = np.empty_like(rows)
    queue_pos[by_rank] = np.arange(len(rows)) - first
    step = queue_pos // max(1, batch_tokens // num_ranks)
    order = np.lexsort((queue_pos, row_rank, step))
    return rows[order], step[order]


def decode_step_order(offsets: np.ndarray, request_start: int, request_stop: int, prompt_tokens: np.ndarray,
                      concurrency: int):
    """Rows of requests [request_start, request_stop) in the `decode` step order, and the step of each.

    prompt_tokens [requests] of those requests. A closed-loop client keeps `concurrency` of them in
    flight, in trace order (module docstring)."""
    if concurrency < 1:
        raise LocusError(f"the decode step order needs at least one request in flight, got {concurrency}")
    lo, hi = int(offsets[request_start]), int(offsets[request_stop])
    tokens = np.diff(offsets[request_start : request_stop + 1])
    prompt = np.asarray(prompt_tokens, dtype=np.int64)
    free = [0] * min(concurrency, max(len(tokens), 1))  # the step each place in flight frees up
    admitted = np.empty(len(tokens), dtype=np.int64)
    for i, decode in enumerate((tokens - prompt).tolist()):
        admitted[i] = heapq.heappop(free)
        heapq.heappush(free, int(admitted[i]) + decode + 1)
    rows = np.arange(lo, hi)
    request = np.searchsorted(offsets, rows, side="right") - 1 - request_start
    position = rows - offsets[request_start + request]
    step = admitted[request] + np.maximum(position - prompt[request] + 1, 0)
    order = np.argsort(step, kind="stable")
    return rows[order], step[order]


def replay(reader, plan: PlacementPlan, topology: Topology, assignment: Assignment, batch_tokens: int = 4096,
           links: LinkModel = LinkModel(), progress: Progress | None = None, step_order: str = "trace",
           pair_sink: PairSink | None = None, epoch_plans: dict[int, PlacementPlan] | None = None,
           dispatch_format: str = "model", combine_format: str = "model", concurrency: int = 16,
           hardware: HardwareProfile | None = None, model_shape: ModelShape | None = None,
           two_batch_overlap: bool = False) -> ReplayReport:
    """Replay the requests of `assignment`'s range under `plan`; `topology` must be the plan's.

    pair_sink, if given, receives every chunk's per-(step, layer, sender, receiver) rows (metrics.PairChunk;
    replay/chakra.py's PairTraffic collects them for Chakra traces); without one nothing extra is computed.
    epoch_plans: a plan per placement epoch (a trace recorded across live re-plans carries each row's
    epoch, `reader.epochs`): every row is routed by its epoch's plan; `plan` is then the first epoch's.
    dispatch_format / combine_format: what the rows travel in (a server's --ep-dispatch-format /
    --ep-combine-format; formats.PAYLOAD_FORMATS): the bytes of a row each way.
    concurrency: requests in flight of the `decode` step order. hardware and model_shape (both or
    neither): also predict every step's time (step_time.py; `two_batch_overlap` as --ep-overlap runs).
    """
    for what, fmt in (("dispatch", dispatch_format), ("combine", combine_format)):
        if fmt not in PAYLOAD_FORMATS:
            raise LocusError(f"{what} format {fmt!r}: choose one of {', '.join(PAYLOAD_FORMATS)}")
    meta = reader.meta
    validate(plan, num_experts=meta.num_experts, moe_layers=meta.moe_layers)
    if plan.topology != topology:
        raise LocusError(f"the plan is laid out for {plan.topology}, not {topology}")
    if step_order not in STEP_ORDERS:
        raise LocusError(f"step order {step_order!r} is not one of {', '.join(STEP_ORDERS)}")
    start, stop = assignment.request_start, assignment.request_stop
    if not 0 <= start <= stop <= len(reader.requests):
        raise LocusError(f"assignment covers requests {start}:{stop}, the trace has {len(reader.requests)}")
    for ranks in (assignment.ranks, assignment.decode_ranks):
        ranks = np.asarray(ranks if ranks is not None else [], dtype=np.int64)
        if len(ranks) and (ranks.min() < 0 or ranks.max() >= topology.ranks):
            bad = int(ranks.min()) if ranks.min() < 0 else int(ranks.max())
            raise LocusError(f"assignment names rank {bad}, topology {topology} has {topology.ranks} ranks")
    if assignment.splits and len(assignment.decode_ranks) != len(assignment.ranks):
        raise LocusError(f"assignment has {len(assignment.decode_ranks)} decode ranks for "
                         f"{len(assignment.ranks)} requests")
    if (hardware is None) != (model_shape is None):
        raise LocusError("a step-time prediction needs both a hardware profile and a model shape")
    if model_shape is not None:
        model_shape.check_trace(meta)
    prompt, prompts = None, None
    if assignment.splits or step_order == "decode" or hardware is not None:
        prompts = np.fromiter((r.prompt_tokens for r in reader.requests[start:stop]), dtype=np.int64,
                              count=stop - start)
    if assignment.splits:
        prompt = prompts
    offsets = np.asarray(reader.offsets, dtype=np.int64)
    lo, hi = int(offsets[start]), int(offsets[stop])
    if hi == lo:
        raise LocusError(f"requests {start}:{stop} hold no tokens; nothing to replay")

    table = build_dispatch_table(plan_in_trace_order(plan, meta.moe_layers))
    epoch_tables, row_epochs = None, None
    if epoch_plans is not None:
        row_epochs = getattr(reader, "epochs", None)
        if row_epochs is None:
            raise LocusError("plans per epoch were given, but the trace records no epochs (epochs.npy)")
        epoch_tables = {}
        for epoch, p in epoch_plans.items():
            validate(p, num_experts=meta.num_experts, moe_layers=meta.moe_layers)
            if p.topology != topology:
                raise LocusError(f"the plan of epoch {epoch} is laid out for {p.topology}, not {topology}")
            epoch_tables[int(epoch)] = build_dispatch_table(plan_in_trace_order(p, meta.moe_layers))
    step_model = None
    if hardware is not None:
        step_model = StepTimeModel(model_shape, hardware, topology, len(meta.moe_layers),
                                   payload_row_bytes(meta.hidden_size, dispatch_format, meta.dtype_bytes),
                                   payload_row_bytes(meta.hidden_size, combine_format, meta.dtype_bytes),
                                   two_batch_overlap)
    meter = TrafficMeter(table, topology, meta.hidden_size, meta.dtype_bytes, batch_tokens, links, pair_sink,
                         epoch_tables, dispatch_format, combine_format, step_model)
    rows_per_chunk = max(1, CHUNK_ROUTINGS // (len(meta.moe_layers) * meta.top_k))
    order = None
    if step_order == "ranks":
        order = rank_step_order(offsets, assignment, topology.ranks, batch_tokens, prompt)
    elif step_order == "decode":
        order = decode_step_order(offsets, start, stop, prompts, concurrency)
    for a in range(0, hi - lo, rows_per_chunk):
        b = min(a + rows_per_chunk, hi - lo)
        if order is None:
            rows, steps = np.arange(lo + a, lo + b), None
            ids = np.asarray(reader.expert_ids[lo + a : lo + b])
        else:
            rows, steps = order[0][a:b], order[1][a:b]
            ids = np.asarray(reader.expert_ids[rows])
        request = np.searchsorted(offsets, rows, side="right") - 1  # [T] request index of each row
        position = rows - offsets[request]
        epochs = None if row_epochs is None else np.asarray(row_epochs[rows])
        decode = None if step_model is None else position >= prompts[request - start]
        meter.add(ids, assignment.row_ranks(request - start, position, prompt), position, steps, epochs, decode)
        if progress is not None:
            progress(b, hi - lo)

    totals = meter.finish()
    step_time = None
    if step_model is not None:
        step_time = {"hardware": hardware.name, "model_shape": model_shape.name,
                     "two_batch_overlap": bool(two_batch_overlap), "host_overlap": hardware.host_overlap,
                     **step_model.finish().summary()}
    return ReplayReport.from_totals(
        totals,
        model=meta.model,
        planner=plan.planner,
        topology=topology,
        assignment=assignment.policy,
        requests=(start, stop),
        batch_tokens=batch_tokens,
        step_order=step_order,
        moe_layers=meta.moe_layers,
        links=links,
        migrations=assignment.migrations,
        migrated_kv_bytes=assignment.migrated_kv_bytes,
        dispatch=table.rule,
        dispatch_format=dispatch_format,
        combine_format=combine_format,
        concurrency=concurrency if step_order == "decode" else None,
        step_time=step_time,
    )
