"""The grouper as an expert-parallel server runs it live: what `locus replay --assign grouper` replays.

A live server's rank 0 admits each request when it arrives and releases its charge when it
finishes (locus/engine/ep/ranks/driver.py), with the plan's grouper under the stream cap and the attention
cap (grouper.py). Which rank a request gets depends on what is in flight at that moment, so the
replay runs the same grouper through the same sequence of admissions and releases:

  recorded  the sequence the server logged (RequestRecord.admitted / .released, written by an
            expert-parallel recording): the assignment the server made, simulated, not copied;
  closed    a closed-loop client with `concurrency` requests in flight, sending the next request in
            trace order as soon as one finishes; finishing follows the lockstep step model below;
  batch     every request admitted in trace order before any finishes (no release at all): what the
            planner assumes when it groups its planning requests.

Step model (closed). Ranks step in lockstep and every running request advances one token per step: a
request admitted before step a runs its prefill in step a (its first token) and its last token in
step a + g - 1 (g = tokens it generates: trace tokens - prompt + 1, since the last sampled token is
never fed back). Rank 0 sees its own outputs after the step that made them, the other ranks' one
iteration later (their report travels with the next iteration). The client answers a release with the
next request `client_delay` steps later (default 1: the answer travels to the client and the next
request back while the ranks run the next step). Releases at one boundary come before admissions.

What a request is charged: the charge the server recorded, else prompt + g (what a request with
max_tokens = g, as a fixed-length workload sends, is charged). Its streams: 1 (a recorded n > 1
request's choices share one admission and count as its streams).

Untagged requests (no tag, a tag the plan does not know, or `untagged=True`: tags withheld) are placed
by the grouper's prompt predictor from their prompt token ids (`prompts`), as rank 0 places them: the
domain it classifies them as, else the node cost it predicts; least loaded without one.
With `moves`, every request's prefill signature is offered to the grouper's cost model after its
prefill (the move of docs/planner.md); the KV cache a move sends is counted as migration bytes. Where
the server moved requests live (--ep-moves), its log also holds where it offered each prefill
(`observed`): the replay offers it at that point of the sequence, and a move it replays sends the KV
positions the live one sent (`moved_tokens`; else the prompt's), at the trace's KV bytes per token.

Shape legend: R requests, N nodes, L MoE layers, E experts.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from locus.errors import LocusError
from locus.routing.grouping.grouper import Grouper
from locus.routing.grouping.node_cost import NodeCostModel
from locus.routing.plan.grouping_spec import spec_of
from locus.routing.replay.assignment import Assignment

ARRIVALS = ("recorded", "closed", "batch")


def live_grouper(plan, model_config=None, moe_layers=None, moves: bool = False) -> Grouper:
    """The grouper an expert-parallel server's rank 0 admits with under `plan` (and the replay runs):
    the stream cap, the plan's attention cap, the plan's prompt predictor for untagged requests
    (refused if `model_config` is another model's), moves after prefill only with `moves`."""
    spec = spec_of(plan)
    if moe_layers is None:
        moe_layers = tuple(model_config.moe_layers) if model_config is not None else tuple(plan.moe_layers)
    predictor = spec.predictor
    if predictor is not None and model_config is not None:
        predictor.check_model(model_config.vocab_size, model_config.moe_layers, model_config.num_local_experts)
    cost = NodeCostModel.from_plan(plan, spec, moe_layers)
    return Grouper(plan.topology, spec, cost, balance_streams=True, predictor=predictor, moves=moves)


def serving_grouper(plan, model_config=None, moves: bool = False) -> Grouper | None:
    """The grouper rank 0 admits requests with under `plan`: `live_grouper`'s when the plan has a
    grouping; None when it has none (balanced admission). It moves requests after their prefill only
    with `moves`."""
    return live_grouper(plan, model_config, moves=moves) if plan.grouping else None


@dataclass(frozen=True)
class LiveRequests:
    """What the admission sees of the replayed requests, in trace order."""

    ids: list[str]
    domains: list[str]
    prompt_tokens: np.ndarray  # [R] int64
    tokens: np.ndarray  # [R] int64: trace rows (prompt + generated - 1)
    charges: np.ndarray  # [R] int64: tokens charged at admission
    admitted: np.ndarray | None = None  # [R] int64: recorded admission sequence numbers
    released: np.ndarray | None = None  # [R] int64: recorded release sequence numbers (-1: never released)
    observed: np.ndarray | None = None  # [R] int64: where the server offered its prefill to the grouper (-1: never)
    moved_tokens: np.ndarray | None = None  # [R] int64: KV positions its live move sent (-1: it did not move)

    @classmethod
    def from_records(cls, records) -> "LiveRequests":
        prompt = np.fromiter((r.prompt_tokens for r in records), dtype=np.int64, count=len(records))
        tokens = np.fromiter((r.tokens for r in records), dtype=np.int64, count=len(records))
        charges = np.array([r.charge if r.charge is not None else r.tokens + 1 for r in records], dtype=np.int64)
        admitted = released = observed = moved = None
        if records and all(r.admitted is not None for r in records):
            admitted = np.array([r.admitted for r in records], dtype=np.int64)
            released = np.array([-1 if r.released is None else r.released for r in records], dtype=np.int64)
            if any(r.observed is not None for r in records):
                observed = np.array([-1 if r.observed is None else r.observed for r in records], dtype=np.int64)
        if any(r.moved_tokens is not None for r in records):
            moved = np.array([-1 if r.moved_tokens is None else r.moved_tokens for r in records], dtype=np.int64)
        return cls([r.id for r in records], [r.domain for r in records], prompt, tokens, charges, admitted, released,
                   observed, moved)

    @property
    def generated(self) -> np.ndarray:
        """Tokens each request generates (its last one never runs through the model)."""
        return np.maximum(self.tokens - self.prompt_tokens + 1, 1)


def default_arrivals(requests: LiveRequests) -> str:
    return "recorded" if requests.admitted is not None else "closed"


def describe_arrivals(arrivals: str, concurrency: int = 16, client_delay: int = 1) -> str:
    """An arrival model in words, for tables and logs (`concurrency` and `client_delay`: closed's)."""
    if arrivals == "recorded":
        return "arrivals as the server recorded them"
    if arrivals == "batch":
        return "all admitted in trace order, none finishing"
    return (f"a closed-loop client of {concurrency} requests in flight, the next sent {client_delay} "
            f"step{'s' if client_delay != 1 else ''} after each release")


def run_live(grouper: Grouper, requests: LiveRequests, arrivals: str = "closed", concurrency: int = 16,
             prompts: list | None = None, prefill_bytes: np.ndarray | None = None,
             untagged: bool = False, request_start: int = 0, client_delay: int = 1,
             kv_bytes_per_token: int | None = None) -> Assignment:
    """Admit and release every request as the live server would (module docstring). `prompts`: each
    request's prompt token ids (or None), for the grouper's predictor; `prefill_bytes` [R, N]: its node
    cost from its prefill signature, offered to the grouper's move after prefill (None: no moves).
    `kv_bytes_per_token`: what a moved position's KV cache takes (the model's, as a recording engine
    wrote it in the trace; None: the plan's grouping figure)."""
    if arrivals not in ARRIVALS:
        raise LocusError(f"unknown arrival model {arrivals!r}; choose one of {', '.join(ARRIVALS)}")
    R = len(requests.ids)
    if prefill_bytes is not None and np.shape(prefill_bytes) != (R, grouper.N):
        raise LocusError(f"prefill_bytes must be [{R} requests, {grouper.N} nodes], got {np.shape(prefill_bytes)}")
    if prompts is not None and len(prompts) != R:
        raise LocusError(f"prompts must hold one entry per request ({R}), got {len(prompts)}")
    sim = _Admission(grouper, requests, prompts, prefill_bytes, untagged)
    if arrivals == "recorded":
        sim.replay_recorded()
    elif arrivals == "batch":
        for i in range(R):
            sim.admit([i])
    else:
        if concurrency < 1:
            raise LocusError(f"the concurrency of a closed-loop client must be at least 1, got {concurrency}")
        if client_delay < 0:
            raise LocusError(f"the client's delay is a number of steps >= 0, got {client_delay}")
        sim.closed_loop(concurrency, client_delay)
    ranks, decode = sim.ranks, sim.decode
    moved = decode != ranks
    stats = grouper.stats
    if not moved.any():
        return Assignment("grouper", request_start, ranks, None, migrations=int(stats.moves),
                          migrated_kv_bytes=int(stats.migrated_kv_bytes))
    split = requests.prompt_tokens.copy()
    if requests.moved_tokens is not None:  # the positions the live move sent, where it moved live
        live = moved & (requests.moved_tokens >= 0)
        split[live] = requests.moved_tokens[live]
    kv = grouper.spec.kv_bytes_per_token if kv_bytes_per_token is None else int(kv_bytes_per_token)
    across = moved & (ranks // grouper.G != decode // grouper.G)
    return Assignment("grouper", request_start, ranks, decode, migrations=int(moved.sum()),
                      migrated_kv_bytes=int((split[across] * kv).sum()), split_at=split)


class _Admission:
    def __init__(self, grouper: Grouper, requests: LiveRequests, prompts, prefill_bytes, untagged: bool):
        self.grouper, self.req = grouper, requests
        self.prompts, self.prefill_bytes, self.untagged = prompts, prefill_bytes, untagged
        R = len(requests.ids)
        self.ranks = np.full(R, -1, dtype=np.int64)
        self.decode = np.full(R, -1, dtype=np.int64)

    def admit(self, batch: list[int], streams: int = 1) -> None:
        """Admit requests arriving at one step boundary, in order, then offer their prefills (unless
        the log says when the server offered them)."""
        g, req = self.grouper, self.req
        for i in batch:
            domain = "" if self.untagged else req.domains[i]
            prompt = None if self.prompts is None else self.prompts[i]
            self.ranks[i] = g.admit(req.ids[i], domain, int(req.charges[i]), int(req.prompt_tokens[i]),
                                    streams=streams, prompt_ids=prompt)
        for i in batch:
            if req.observed is None:
                self.observe(i, streams)
            self.decode[i] = g.rank_of(req.ids[i])

    def observe(self, i: int, streams: int = 1) -> None:
        """Offer request i's prefill signature to the grouper's move."""
        g, req = self.grouper, self.req
        if self.prefill_bytes is not None and req.prompt_tokens[i] > 0 and req.ids[i] in g.live:
            bound = max(float(req.charges[i] - req.prompt_tokens[i]), 0.0) / streams
            remaining = min(bound, g.spec.expected_decode_tokens)
            g.observe_prefill(req.ids[i], node_bytes=self.prefill_bytes[i], remaining_tokens=remaining)
            self.decode[i] = g.rank_of(req.ids[i])

    def release(self, i: int) -> None:
        self.grouper.finish(self.req.ids[i])

    def replay_recorded(self) -> None:
        """The server's own sequence: choices of one request (one admission number) admitted together."""
        req = self.req
        events: list[tuple[int, int, int]] = []  # (sequence number, 0 admit / 1 release / 2 observe, request)
        for i in range(len(req.ids)):
            events.append((int(req.admitted[i]), 0, i))
            if req.released[i] >= 0:
                events.append((int(req.released[i]), 1, i))
            if req.observed is not None and req.observed[i] >= 0:
                events.append((int(req.observed[i]), 2, i))
        events.sort()
        k = 0
        while k < len(events):
            seq, kind, _ = events[k]
            same = [i for s, t, i in events[k:] if s == seq and t == kind]
            k += len(same)
            if kind == 0:
                self._admit_choices(same)
            elif kind == 2:
                for i in same:
                    self.observe(i)
            else:
                for i in same:
                    if self.req.ids[i] in self.grouper.live:
                        self.release(i)

    def _admit_choices(self, choices: list[int]) -> None:
        """One admission; an n > 1 request's choices (trace ids `id#i`) run where the first does."""
        first = choices[0]
        self.admit([first], streams=len(choices))
        for i in choices[1:]:
            self.ranks[i], self.decode[i] = self.ranks[first], self.decode[first]

    def closed_loop(self, concurrency: int, delay: int = 0) -> None:
        """A client keeping `concurrency` requests in flight, in trace order (module docstring): each
        request it gets back is answered by the next one `delay` steps after rank 0 released it."""
        R = len(self.req.ids)
        generated = self.req.generated
        # (step boundary, 0 release / 1 arrival, order, request): a boundary's releases before its arrivals
        events: list[tuple[int, int, int, int]] = []
        nxt = 0

        def arrive(count: int, boundary: int) -> None:
            nonlocal nxt
            for i in range(nxt, min(nxt + count, R)):
                heapq.heappush(events, (boundary, 1, i, i))
            nxt = min(nxt + count, R)

        arrive(concurrency, 0)
        while events:
            boundary = events[0][0]
            released, batch = 0, []
            while events and events[0][0] == boundary:
                _, kind, _, i = heapq.heappop(events)
                if kind == 0:
                    self.release(i)
                    released += 1
                else:
                    batch.append(i)
            self.admit(batch)
            for i in batch:  # prefill in step `boundary`, the last token in step boundary + g - 1
                seen = boundary + int(generated[i]) - 1 + (0 if self.decode[i] == 0 else 1)  # others: a step late
                heapq.heappush(events, (seen + 1, 0, i, i))
            arrive(released, boundary + delay)


PREDICTORS = ("auto", "table", "none")


@dataclass(frozen=True)
class LiveSimulation:
    assignment: Assignment
    arrivals: str
    predictor: str  # what placed the untagged requests: "table" or "none" (least loaded)
    untagged: int  # requests the grouper saw without a known tag
    by_prediction: int  # of which the predictor placed (by the domain it classified, or its predicted cost)
    overflowed: int  # admissions whose preferred nodes were all full


def simulate_live(plan, reader, start: int, stop: int, arrivals: str | None = None, concurrency: int = 16,
                  untagged: bool = False, predictor: str = "auto", moves: bool = False,
                  stream_cap: bool = True, client_delay: int = 1) -> LiveSimulation:
    """The live admission over trace requests [start, stop) (module docstring). `predictor`: "table"
    (the plan's token-affinity table, on the prompt token ids the trace recorded), "none" (untagged
    requests to the least-loaded rank), "auto" (the table where the plan has one and the trace has
    token ids). `arrivals` None: recorded where the trace carries its admissions, else closed.
    `stream_cap` False drops the stream cap (not what a server does: for measuring what it costs)."""
    from locus.routing.grouping.simulation import trace_prefill_chunks

    if predictor not in PREDICTORS:
        raise LocusError(f"unknown predictor {predictor!r}; choose one of {', '.join(PREDICTORS)}")
    meta = reader.meta
    requests = LiveRequests.from_records(reader.requests[start:stop])
    arrivals = arrivals or default_arrivals(requests)
    if arrivals == "recorded" and requests.admitted is None:
        raise LocusError(f"{reader.path}: the requests carry no recorded admissions (the trace was not recorded by an "
                         "expert-parallel server of this Locus); use --arrivals closed or batch")
    grouper = live_grouper(plan, moe_layers=meta.moe_layers, moves=moves)
    grouper.balance_streams = stream_cap
    table = grouper.predictor
    if predictor == "table" and table is None:
        raise LocusError("--predictor table: the plan has no prompt predictor (plan from a trace with token ids)")
    if table is not None and predictor != "none" and reader.token_ids is None:
        if predictor == "table":
            raise LocusError(f"{reader.path}: the trace has no token ids (token_ids.npy): the predictor has no prompts "
                             "to predict from")
        table = None
    if predictor == "none":
        table = None
    if table is not None:
        table.check_model(meta.vocab_size if meta.vocab_size is not None else table.vocab_size, meta.moe_layers,
                          meta.num_experts, "the trace")
    grouper.predictor = table
    R, N = len(requests.ids), grouper.N
    blind = [untagged or not grouper.knows(d) for d in requests.domains]
    prompts = None
    if table is not None:  # the prompts the predictor reads, as the server got them
        offsets, prompts = reader.offsets, [None] * R
        for i in np.flatnonzero(blind):
            lo = int(offsets[start + i])
            prompts[i] = np.asarray(reader.token_ids[lo : lo + int(requests.prompt_tokens[i])], dtype=np.int64)
    prefill = None
    if moves:
        prefill = np.zeros((R, N))
        for lo, hi, counts in trace_prefill_chunks(reader, start, stop):
            if hi > lo and requests.observed is not None:  # one at a time, as the server scored them
                prefill[lo:hi] = [grouper.cost.expected_bytes(c) for c in counts]
            elif hi > lo:
                prefill[lo:hi] = grouper.cost.expected_bytes(counts)
    assignment = run_live(grouper, requests, arrivals, concurrency, prompts, prefill, untagged, start, client_delay,
                          meta.kv_bytes_per_token)
    return LiveSimulation(assignment, arrivals, "table" if table is not None else "none", int(sum(blind)),
                          grouper.stats.admitted_by_prediction, grouper.stats.overflowed)
