"""How sure a comparison of expert imbalance is: each request's expert load per rank, and a paired
bootstrap over requests.

The whole-replay expert imbalance (`locus replay`'s `expert_imbalance_mean`: per MoE layer, the busiest
rank's routed tokens over the mean rank's, averaged over layers) of a few hundred requests moves with
which requests were served: a handful of long generations that keep hitting one expert decide which
rank is busiest. Two plans (or two assignments) compared on one served set differ by their design and
by that set. Resampling the requests with replacement, the same draw for both sides, and recomputing
both imbalances gives the spread a comparison would have on another served set of the same size.

Shape legend: Q requests (the assignment's range), L MoE layers (the trace's order), R ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.errors import LocusError
from locus.routing.dispatch_rule import build_dispatch_table, destinations, table_keys
from locus.routing.plan.placement import validate
from locus.routing.replay.assignment import Assignment
from locus.routing.replay.simulator import plan_in_trace_order
from locus.traces.metrics import max_over_mean

ROWS_PER_CHUNK = 1 << 16  # trace rows routed at once: bounds the [rows, L, K] destination arrays
DEFAULT_DRAWS = 2000
DRAWS_PER_BATCH = 250  # resamples multiplied at once: bounds the [draws, Q] weights and [draws, L, R] totals
# The interval is the point +- Z95 standard deviations of the resampled differences. Not their
# percentiles: a resample draws some requests twice, which adds its own noise to every rank's load, and
# the max over ranks rises with noise, more on the side whose loads hang on fewer requests; so the
# resampled differences centre away from the served one (by up to 0.03 on a 64-rank trace), while their
# spread is what another served set would show.
Z95 = 1.959964


@dataclass(frozen=True)
class ImbalanceDifference:
    """a - b of the whole-replay expert imbalance (mean over layers), on the served requests and over
    resamples of them."""

    point: float  # on the requests as served
    low: float  # point -+ Z95 sd: a 95 % interval
    high: float
    sd: float  # standard deviation of the resampled differences
    a: float  # the two imbalances on the requests as served
    b: float
    requests: int
    draws: int

    def as_dict(self) -> dict:
        return {"point": self.point, "ci95": [self.low, self.high], "sd": self.sd, "a": self.a, "b": self.b,
                "requests": self.requests, "draws": self.draws}


def request_rank_loads(reader, plan, assignment: Assignment, first_rows: np.ndarray | None = None) -> np.ndarray:
    """[Q, L, R] int32: the routed tokens of each request of `assignment`'s range that each rank's experts
    take, per MoE layer, under `plan`'s dispatch rule (the replay's: summed over requests, these are the
    loads `locus replay` reports the expert imbalance of). `first_rows` [Q]: count only each request's
    rows at positions below it (its prompt's, given the prompt lengths)."""
    meta = reader.meta
    validate(plan, num_experts=meta.num_experts, moe_layers=meta.moe_layers)
    start, stop = assignment.request_start, assignment.request_stop
    if not 0 <= start <= stop <= len(reader.requests):
        raise LocusError(f"assignment covers requests {start}:{stop}, the trace has {len(reader.requests)}")
    offsets = np.asarray(reader.offsets, dtype=np.int64)
    lo, hi = int(offsets[start]), int(offsets[stop])
    epochs = getattr(reader, "epochs", None)
    if epochs is not None and len(np.unique(np.asarray(epochs[lo:hi]))) > 1:
        raise LocusError(f"{reader.path}: the requests span placement epochs (a live re-plan); the loads of one plan "
                         "would not be the served ones")
    table = build_dispatch_table(plan_in_trace_order(plan, meta.moe_layers))
    R, L, Q = table.num_ranks, len(meta.moe_layers), stop - start
    prompts = None
    if assignment.splits:
        prompts = np.fromiter((r.prompt_tokens for r in reader.requests[start:stop]), dtype=np.int64, count=Q)
    if first_rows is not None:
        first_rows = np.asarray(first_rows, dtype=np.int64)
        if first_rows.shape != (Q,):
            raise LocusError(f"first_rows must hold one count per request ({Q}), got shape {first_rows.shape}")
    loads = np.zeros((Q, L, R), dtype=np.int32)
    for a in range(lo, hi, ROWS_PER_CHUNK):
        rows = np.arange(a, min(a + ROWS_PER_CHUNK, hi))
        request = np.searchsorted(offsets, rows, side="right") - 1 - start  # [T] within the range
        position = rows - offsets[request + start]
        src = assignment.row_ranks(request, position, prompts)
        ids = np.asarray(reader.expert_ids[rows])  # [T, L, K]
        if first_rows is not None:
            ids = np.where((position < first_rows[request])[:, None, None], ids, -1)  # -1: routed nowhere
        dest = destinations(table, table_keys(table, ids, src), position).astype(np.int64)  # R: no expert
        first = int(request[0])
        span = int(request[-1]) - first + 1
        key = ((request - first)[:, None, None] * L + np.arange(L)[None, :, None]) * (R + 1) + dest
        counts = np.bincount(key.ravel(), minlength=span * L * (R + 1)).reshape(span, L, R + 1)
        loads[first : first + span] += counts[..., :R].astype(np.int32)
    return loads


def expert_imbalance(loads: np.ndarray) -> float:
    """The whole-replay expert imbalance of per-request loads [Q, L, R] (or their sum [L, R]): per layer
    max / mean over ranks, averaged over the layers that carry load (as the replay reports it)."""
    total = loads.sum(0) if loads.ndim == 3 else loads
    return float(_imbalances(total[None].astype(np.float64))[0])


def _imbalances(totals: np.ndarray) -> np.ndarray:
    """expert_imbalance of every draw's totals [n, L, R], [n]; nan for a draw no layer of which carries load."""
    per_layer = max_over_mean(totals, np.nan)  # [n, L]
    known = ~np.isnan(per_layer)
    layers = known.sum(1)
    return np.where(layers > 0, np.where(known, per_layer, 0.0).sum(1) / np.maximum(layers, 1), np.nan)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, draws: int = DEFAULT_DRAWS, seed: int = 0) -> ImbalanceDifference:
    """The expert imbalance of loads `a` minus that of `b` (both [Q, L, R], request i the same request in
    both), on the requests as given and over `draws` resamples of them, the same resample for both."""
    if a.shape != b.shape or a.ndim != 3:
        raise LocusError(f"a paired bootstrap needs loads [requests, layers, ranks] of one shape, got {a.shape} and {b.shape}")
    if a.shape[0] == 0:
        raise LocusError("a paired bootstrap needs at least one request")
    if draws < 1:
        raise LocusError(f"a bootstrap needs at least one draw, got {draws}")
    rng = np.random.default_rng(seed)
    Q, L, R = a.shape
    flat_a = a.reshape(Q, L * R).astype(np.float64)
    flat_b = b.reshape(Q, L * R).astype(np.float64)
    diffs = np.empty(draws)
    for first in range(0, draws, DRAWS_PER_BATCH):
        n = min(DRAWS_PER_BATCH, draws - first)
        picks = np.stack([np.bincount(rng.integers(0, Q, Q), minlength=Q) for _ in range(n)]).astype(np.float64)
        # [n, Q] times each request is drawn; the resampled loads [n, L, R] are one product per side
        diffs[first : first + n] = (_imbalances((picks @ flat_a).reshape(n, L, R))
                                    - _imbalances((picks @ flat_b).reshape(n, L, R)))
    ia, ib = expert_imbalance(a), expert_imbalance(b)
    point, sd = ia - ib, float(diffs.std())
    return ImbalanceDifference(point, point - Z95 * sd, point + Z95 * sd, sd, ia, ib, Q, draws)
