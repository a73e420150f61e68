"""The online micro-batch grouper: which rank (and so which node's micro-batch) runs each request.

    admit(request_id, domain, num_tokens)       -> rank     before prefill: domain tag, else least loaded
    observe_prefill(request_id, signature)      -> rank | None   after prefill: move if it pays
    finish(request_id)                                      its tokens leave the rank loads

Admission. A request with a domain the plan knows goes to that domain's nodes, keeping the domain's
tokens split over them in the plan's proportions (the node furthest below its share first); one
without goes to the least-loaded rank. Within a node, the least-loaded rank (ties: lowest).

After prefill its expert signature (per-layer expert counts of its prompt) is known, and the cost
model (node_cost.py) gives its expected inter-node bytes per decode token on every node. Cost model
of a move from node a to node b:
    saved     = (bytes_a - bytes_b) * expected remaining decode tokens   (the spec's planning mean,
                unless the caller knows better)
    migration = prompt tokens * kv_bytes_per_token                        (its KV cache crosses nodes)
It moves, between steps, to the node saving the most, only if saved > move_margin * migration.

Attention cap. Every placement (admission or move) must leave the target rank at or under
cap * mean (at admission: or at most one request above the mean, see _fits); when no preferred rank
can take a request, it goes to the least-loaded rank (what a load-balancing front end would do
anyway). Loads are the tokens charged to a rank: `num_tokens` at admission, the not-yet-computed part
moving with a request.

Stream cap (`balance_streams`, what expert-parallel serving uses). Ranks step in lockstep, so a decode
step lasts as long as the rank with the most sequences takes: one stream above the others costs every
rank. With the cap, an admission may also never leave a rank with more live sequences than
ceil(total / ranks); the domain still picks the node and rank wherever that holds.

No engine imports here: the engine's adapter is locus/engine/observers/plan_grouping.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.grouping_spec import GroupingSpec, spec_of
from locus.routing.grouping.node_cost import NodeCostModel
from locus.routing.plan.topology import Topology
from locus.traces.metrics import max_over_mean


@dataclass
class _Live:
    rank: int
    prompt_tokens: int
    charges: dict[int, float] = field(default_factory=dict)  # rank -> tokens charged there
    observed: bool = False
    streams: int = 1


@dataclass
class GrouperStats:
    admitted: int = 0
    admitted_by_domain: int = 0
    overflowed: int = 0  # placed on the least-loaded rank because no preferred rank fitted the cap
    moves: int = 0
    migrated_kv_bytes: int = 0  # inter-node bytes of KV cache moved


class Grouper:
    def __init__(self, topology: Topology, spec: GroupingSpec, cost: NodeCostModel | None = None,
                 attention_cap: float | None = None, balance_streams: bool = False):
        self.topology, self.spec, self.cost = topology, spec, cost
        self.balance_streams = balance_streams
        self.cap = float(spec.caps.attention if attention_cap is None else attention_cap)
        if self.cap < 1.0:
            raise LocusError(f"attention cap must be >= 1.0, got {self.cap}")
        self.R, self.G, self.N = topology.ranks, topology.gpus_per_node, topology.nodes
        self.loads = np.zeros(self.R, dtype=np.float64)  # tokens charged per rank
        self.streams = np.zeros(self.R, dtype=np.int64)  # live sequences per rank
        self.domain_weights = {d: np.asarray(w, dtype=np.float64) / sum(w) for d, w in spec.domain_nodes.items()}
        self.domain_tokens = {d: np.zeros(self.N) for d in spec.domain_nodes}
        self.live: dict[str, _Live] = {}
        self.stats = GrouperStats()

    @classmethod
    def from_plan(cls, plan, attention_cap: float | None = None, moe_layers=None) -> "Grouper":
        """`moe_layers`: the layer order of the signatures that will be observed (default: the plan's)."""
        spec = spec_of(plan)
        return cls(plan.topology, spec, NodeCostModel.from_plan(plan, spec, moe_layers), attention_cap)

    # --- the three calls -------------------------------------------------------------------------
    def admit(self, request_id: str, domain: str | None = None, num_tokens: float = 1,
              prompt_tokens: int | None = None, streams: int = 1) -> int:
        if request_id in self.live:
            raise LocusError(f"grouper: request {request_id!r} is already admitted")
        w = float(max(num_tokens, 0))
        rank = None
        weights = self.domain_weights.get(domain) if domain else None
        if weights is not None:
            self.stats.admitted_by_domain += 1
            done = self.domain_tokens[domain]
            deficit = weights * (done.sum() + w) - done
            for node in sorted(np.flatnonzero(weights > 0), key=lambda n: (-deficit[n], n)):
                rank = self._fits(int(node), w, admission=True, streams=streams)
                if rank is not None:
                    break
            if rank is None:
                self.stats.overflowed += 1
        if rank is None:
            if self.balance_streams:  # the fewest live sequences, then the fewest tokens
                rank = int(np.lexsort((self.loads, self.streams))[0])
            else:
                rank = int(np.argmin(self.loads))
        if weights is not None:
            self.domain_tokens[domain][rank // self.G] += w
        self.loads[rank] += w
        self.streams[rank] += streams
        prompt = int(w if prompt_tokens is None else prompt_tokens)
        self.live[request_id] = _Live(rank, prompt, {rank: w}, streams=streams)
        self.stats.admitted += 1
        return rank

    def observe_prefill(self, request_id: str, signature: np.ndarray | None = None,
                        node_bytes: np.ndarray | None = None, remaining_tokens: float | None = None) -> int | None:
        """Signature: the request's prefill pair counts [L, E] (layers in the order the cost model was
        built for); or pass node_bytes [N], its expected bytes per token on each node, if already
        scored. Returns the new rank if the request moves, else None."""
        req = self._get(request_id)
        if req.observed or self.cost is None:
            req.observed = True
            return None
        req.observed = True
        if node_bytes is None:
            if signature is None:
                raise LocusError("observe_prefill needs a signature or node_bytes")
            node_bytes = self.cost.expected_bytes(signature)
        here = req.rank // self.G
        remaining = self.spec.expected_decode_tokens if remaining_tokens is None else float(remaining_tokens)
        saved = (node_bytes[here] - np.asarray(node_bytes, dtype=np.float64)) * remaining  # [N]
        migration = req.prompt_tokens * self.spec.kv_bytes_per_token
        moving = max(req.charges.get(req.rank, 0.0) - req.prompt_tokens, 0.0)  # the decode still to run
        for node in np.argsort(-saved, kind="stable"):
            if saved[node] <= self.spec.move_margin * migration or node == here:
                break
            rank = self._fits(int(node), moving, admission=False)
            if rank is None:
                continue
            self.loads[req.rank] -= moving
            req.charges[req.rank] -= moving
            self.streams[req.rank] -= req.streams
            self.streams[rank] += req.streams
            self.loads[rank] += moving
            req.charges[rank] = req.charges.get(rank, 0.0) + moving
            req.rank = rank
            self.stats.moves += 1
            self.stats.migrated_kv_bytes += int(migration)
            return rank
        return None

    def finish(self, request_id: str) -> None:
        req = self.live.pop(request_id, None)
        if req is None:
            return
        for rank, tokens in req.charges.items():
            self.loads[rank] = max(self.loads[rank] - tokens, 0.0)
        self.streams[req.rank] -= req.streams

    # --- queries ---------------------------------------------------------------------------------
    def rank_of(self, request_id: str) -> int:
        return self._get(request_id).rank

    def node_of(self, request_id: str) -> int:
        return self._get(request_id).rank // self.G

    def attention_imbalance(self) -> float:
        return float(max_over_mean(self.loads))

    def _get(self, request_id: str) -> _Live:
        try:
            return self.live[request_id]
        except KeyError:
            raise LocusError(f"grouper: request {request_id!r} was never admitted (or has finished)") from None

    def _fits(self, node: int, w: float, admission: bool, streams: int = 1) -> int | None:
        """The node's least-loaded rank if taking `w` more tokens keeps it within the cap; else None.

        Within the cap means at most cap * mean; at admission also at most one request above the mean:
        while the ranks hold only a few requests each, the cap alone would refuse every rank but the
        emptiest (max/mean of a handful of requests is never near 1), and domains would scatter. A move
        is optional, so it gets no such slack (and leaves the total unchanged)."""
        lo = node * self.G
        if self.balance_streams and admission:
            ceiling = -(-(int(self.streams.sum()) + streams) // self.R)
            open_ranks = [r for r in range(lo, lo + self.G) if self.streams[r] + streams <= ceiling]
            if not open_ranks:
                return None
            rank = min(open_ranks, key=lambda r: (self.loads[r], r))
        else:
            rank = lo + int(np.argmin(self.loads[lo : lo + self.G]))
        mean = (self.loads.sum() + (w if admission else 0.0)) / self.R
        limit = max(self.cap * mean, mean + w) if admission else self.cap * mean
        return rank if self.loads[rank] + w <= limit else None
