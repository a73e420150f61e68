"""The online micro-batch grouper: which rank (and so which node's micro-batch) runs each request.

    admit(request_id, domain, num_tokens, node_bytes=None) -> rank   before prefill: domain tag, else the
                                                 predicted node cost, else least loaded
    observe_prefill(request_id, signature)      -> rank | None   after prefill: move if it pays
    finish(request_id)                                      its tokens leave the rank loads

Admission. A request with a domain the plan knows goes to that domain's nodes, keeping the domain's
tokens split over them in the plan's proportions (the node furthest below its share first). One
without, whose prompt the plan's predictor (predictor.py) classifies as a domain the plan knows, goes
where that domain would. Otherwise one with a predicted cost (`node_bytes`, its expected inter-node
bytes per token on every node, or the predictor's from its prompt) goes to the cheapest node that
takes it, then the next cheapest. Otherwise (or when no preferred node takes it) the least-loaded
rank. Within a node, the least-loaded rank (ties: lowest). A tag is a hint: a wrong one puts the
request on a node that costs more bytes, and changes nothing else.

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

Unavailable ranks (`admit(..., unavailable=...)`: a router's backends that are down, or one a request
just failed on). They take no admission, and the caps count the others only: the mean, and the stream
ceiling, are over the ranks that can take the request. The domain still picks the node where one of
its ranks is up.

Lockstep balance (`balance_streams`, what expert-parallel serving and `locus route` use). Ranks step
in lockstep, so a decode step lasts as long as the busiest rank takes. Three rules keep the ranks level
while the domain still picks the node wherever they hold:
  stream cap     an admission (or a move) never leaves a rank with more live sequences than
                 max(ceil(total / ranks), floor(STREAM_CAP * total / ranks)): one above the others
                 while the ranks hold few, STREAM_CAP times the mean when they hold many (a hard ceil there
                 forces each admission onto whichever rank just freed a slot, whatever its tokens, and a
                 tight one sends requests off their domain's nodes, and the plan's expert balance with them);
  admitted cap   once every rank holds a request, an admission also keeps the rank's tokens admitted
                 so far within ADMITTED_CAP_SHARE of the attention cap's slack over their mean (or one
                 request above it): the in-flight cap alone lets a node whose requests finish sooner
                 take more prefills every lifetime, and the whole run's imbalance follows the tokens
                 admitted; with fewer requests than ranks some ranks idle anyway and affinity wins;
  overflow       a request no preferred rank takes goes to the rank under the stream cap with the
                 fewest tokens in flight, then the fewest admitted (the fewest admitted first once every
                 rank holds a request); within a node, the rank with the fewest tokens admitted among
                 those the three caps allow (a node is refused only when none of its ranks fits).
Ties go to the lowest rank.

No engine imports here: the engine's adapter is locus/engine/policies/plan_grouping.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.grouping_spec import GroupingSpec, spec_of
from locus.routing.grouping.node_cost import NodeCostModel
from locus.routing.plan.predictor import TokenAffinity
from locus.routing.plan.topology import Topology
from locus.traces.metrics import max_over_mean

# Live sequences a rank may hold over the mean once the ranks hold four or more each (lockstep balance).
# The attention cap keeps the tokens level; a tighter stream cap refuses a domain's nodes often enough to
# lose the plan's expert balance (docs/planner.md, "Live admission and balance").
STREAM_CAP = 1.30
# What share of the attention cap's slack the tokens admitted over the run get (lockstep balance, above).
# With every request in flight the whole run's attention imbalance is the admitted one; the target is
# within 0.05 of a balanced assignment's (about 1.00), so the bound must sit below 1.05, not at it.
ADMITTED_CAP_SHARE = 0.4


@dataclass
class _Live:
    rank: int
    prompt_tokens: int
    charges: dict[int, float] = field(default_factory=dict)  # rank -> tokens charged there
    observed: bool = False
    streams: int = 1


@dataclass(frozen=True)
class AdmissionChoice:
    """Why the last admission went where it did (a router logs it beside the rank)."""

    how: str  # "tagged" (a domain the plan knows), "predicted" (the prompt predictor), "least-loaded"
    domain: str | None  # the domain that placed it: the tag, or the one the predictor classified; None else
    overflowed: bool = False  # no preferred rank fitted the caps: it went to the least-loaded rank


@dataclass
class GrouperStats:
    admitted: int = 0
    admitted_by_domain: int = 0
    admitted_by_prediction: int = 0  # no known domain: placed by the predicted domain or node cost
    overflowed: int = 0  # placed on the least-loaded rank because no preferred rank fitted the cap
    moves: int = 0
    migrated_kv_bytes: int = 0  # inter-node bytes of KV cache moved


class Grouper:
    def __init__(self, topology: Topology, spec: GroupingSpec, cost: NodeCostModel | None = None,
                 attention_cap: float | None = None, balance_streams: bool = False,
                 predictor: TokenAffinity | None = None, moves: bool = True):
        """`predictor` (with `cost`): places untagged requests by their prompt's predicted node cost.
        `moves` (with `cost`): observe_prefill may move a request."""
        self.topology, self.spec, self.cost = topology, spec, cost
        self.balance_streams, self.moves = balance_streams, moves
        self.predictor = predictor if cost is not None else None
        self.cap = float(spec.caps.attention if attention_cap is None else attention_cap)
        if self.cap < 1.0:
            raise LocusError(f"attention cap must be >= 1.0, got {self.cap}")
        self.R, self.G, self.N = topology.ranks, topology.gpus_per_node, topology.nodes
        self.loads = np.zeros(self.R, dtype=np.float64)  # tokens charged per rank
        self.streams = np.zeros(self.R, dtype=np.int64)  # live sequences per rank
        self.admitted = np.zeros(self.R, dtype=np.float64)  # tokens ever charged per rank (moves carry theirs)
        self.domain_weights = {d: np.asarray(w, dtype=np.float64) / sum(w) for d, w in spec.domain_nodes.items()}
        self.domain_tokens = {d: np.zeros(self.N) for d in spec.domain_nodes}
        self.live: dict[str, _Live] = {}
        self.stats = GrouperStats()
        self.last_choice: AdmissionChoice | None = None

    @classmethod
    def from_plan(cls, plan, attention_cap: float | None = None, moe_layers=None, balance_streams: bool = False,
                  predictor: bool = False) -> "Grouper":
        """`moe_layers`: the layer order of the signatures that will be observed (default: the plan's).
        `predictor`: also the plan's prompt predictor, where it has one."""
        spec = spec_of(plan)
        cost = NodeCostModel.from_plan(plan, spec, moe_layers)
        if predictor and spec.predictor is not None and moe_layers is not None:
            spec.predictor.check_model(spec.predictor.vocab_size, moe_layers, plan.num_experts)
        return cls(plan.topology, spec, cost, attention_cap, balance_streams,
                   spec.predictor if predictor else None)

    def knows(self, domain: str | None) -> bool:
        """Whether a request with this tag goes to the tag's nodes (else it is untagged to the grouper)."""
        return bool(domain) and domain in self.domain_weights

    def predicted_bytes(self, prompt_ids) -> np.ndarray | None:
        """A prompt's predicted inter-node bytes per token on every node [N], before its prefill; None
        without a predictor."""
        if self.predictor is None:
            return None
        return self.cost.expected_bytes(self.predictor.signature(prompt_ids))

    # --- the three calls -------------------------------------------------------------------------
    def admit(self, request_id: str, domain: str | None = None, num_tokens: float = 1,
              prompt_tokens: int | None = None, streams: int = 1, node_bytes: np.ndarray | None = None,
              prompt_ids=None, unavailable=()) -> int:
        """`node_bytes` [N]: the request's predicted inter-node bytes per token on every node, used
        when its domain is not one the plan knows; or `prompt_ids`, for the plan's predictor to
        predict them. `unavailable`: ranks that take nothing now (module docstring)."""
        if request_id in self.live:
            raise LocusError(f"grouper: request {request_id!r} is already admitted")
        closed = self._closed(unavailable)
        w = float(max(num_tokens, 0))
        rank = None
        weights = self.domain_weights.get(domain) if domain else None
        predicted = False
        if weights is None and prompt_ids is not None and self.predictor is not None:
            guess = self.predictor.classify(prompt_ids)
            if guess in self.domain_weights:
                domain, weights, predicted = guess, self.domain_weights[guess], True
            elif node_bytes is None:
                node_bytes = self.predicted_bytes(prompt_ids)
        preferred: list[int] = []
        if weights is not None:
            if predicted:
                self.stats.admitted_by_prediction += 1
            else:
                self.stats.admitted_by_domain += 1
            done = self.domain_tokens[domain]
            deficit = weights * (done.sum() + w) - done
            preferred = sorted(np.flatnonzero(weights > 0).tolist(), key=lambda n: (-deficit[n], n))
        elif node_bytes is not None:
            cost = np.asarray(node_bytes, dtype=np.float64)
            if cost.shape != (self.N,):
                raise LocusError(f"grouper: node_bytes must hold one cost per node ({self.N}), got shape {cost.shape}")
            self.stats.admitted_by_prediction += 1
            preferred = np.argsort(cost, kind="stable").tolist()
        for node in preferred:
            rank = self._fits(int(node), w, admission=True, streams=streams, closed=closed)
            if rank is not None:
                break
        overflowed = bool(preferred) and rank is None
        if overflowed:
            self.stats.overflowed += 1
        if rank is None:
            rank = self._least_loaded(closed)
        how = ("predicted" if predicted else "tagged") if weights is not None else (
            "predicted" if node_bytes is not None else "least-loaded")
        self.last_choice = AdmissionChoice(how, domain if weights is not None else None, overflowed)
        if weights is not None:
            self.domain_tokens[domain][rank // self.G] += w
        self.loads[rank] += w
        self.admitted[rank] += w
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
        if req.observed or self.cost is None or not self.moves:
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
            rank = self._fits(int(node), moving, admission=False, streams=req.streams)
            if rank is None:
                continue
            self.loads[req.rank] -= moving
            self.admitted[req.rank] -= moving
            self.admitted[rank] += moving
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

    def _closed(self, unavailable) -> np.ndarray | None:
        """[R] bool mask of the ranks that take nothing (None: every rank is open, the common case)."""
        if not len(unavailable):
            return None
        closed = np.zeros(self.R, dtype=bool)
        for rank in unavailable:
            if not 0 <= int(rank) < self.R:
                raise LocusError(f"grouper: unavailable rank {rank} is not one of the {self.R} ranks")
            closed[int(rank)] = True
        if closed.all():
            raise LocusError(f"grouper: none of the {self.R} ranks can take a request (all unavailable)")
        return closed

    def _least_loaded(self, closed: np.ndarray | None) -> int:
        """Where a request no preferred rank took goes (module docstring); open ranks only."""
        ranks = np.arange(self.R) if closed is None else np.flatnonzero(~closed)
        if not self.balance_streams:
            return int(ranks[np.argmin(self.loads[ranks])])
        under = ranks[self.streams[ranks] + 1 <= self._stream_ceiling(ranks, 1)]
        if not len(under):  # an n > 1 request's streams over-fill every rank: the fewest streams
            under = ranks[self.streams[ranks] == self.streams[ranks].min()]
        first, second = self.loads[under], self.admitted[under]
        if self._every_rank_busy(ranks):
            first, second = second, first
        return int(under[np.lexsort((under, second, first))[0]])

    def _fits(self, node: int, w: float, admission: bool, streams: int = 1,
              closed: np.ndarray | None = None) -> int | None:
        """The rank of `node` that takes `w` more tokens within the caps; else None. Caps count the open
        ranks only (`closed`: the unavailable ones).

        Within the attention cap means at most cap * mean; at admission also at most one request above
        the mean: while the ranks hold only a few requests each, the cap alone would refuse every rank
        but the emptiest (max/mean of a handful of requests is never near 1), and domains would scatter.
        A move is optional, so it gets no such slack (and leaves the total unchanged)."""
        ranks = np.arange(self.R) if closed is None else np.flatnonzero(~closed)
        candidates = [r for r in range(node * self.G, (node + 1) * self.G) if closed is None or not closed[r]]
        count = len(ranks)
        mean = (self.loads[ranks].sum() + (w if admission else 0.0)) / count
        limit = max(self.cap * mean, mean + w) if admission else self.cap * mean
        if not self.balance_streams:
            if not candidates:
                return None
            rank = min(candidates, key=lambda r: (self.loads[r], r))
            return rank if self.loads[rank] + w <= limit else None
        ceiling = self._stream_ceiling(ranks, streams if admission else 0)
        admitted_limit = np.inf
        if admission and self._every_rank_busy(ranks):
            admitted_mean = (self.admitted[ranks].sum() + w) / count
            share = 1.0 + ADMITTED_CAP_SHARE * (self.cap - 1.0)
            admitted_limit = max(share * admitted_mean, admitted_mean + w)
        # Every rank of the node is tried, the fewest admitted first: with many GPUs a node, its
        # fewest-admitted rank is often the one over the in-flight cap while another has room, and
        # refusing the node there sends the request off its domain's node (overflow).
        for rank in sorted(candidates, key=lambda r: (self.admitted[r], self.loads[r], r)):
            if (self.streams[rank] + streams <= ceiling and self.loads[rank] + w <= limit
                    and self.admitted[rank] + w <= admitted_limit):
                return rank
        return None

    def _stream_ceiling(self, ranks: np.ndarray, adding: int) -> int:
        """The most live sequences a rank of `ranks` may hold after `adding` more (module docstring)."""
        total = int(self.streams[ranks].sum()) + adding
        return max(-(-total // len(ranks)), int(STREAM_CAP * total / len(ranks)))

    def _every_rank_busy(self, ranks: np.ndarray) -> bool:
        """Whether the live requests are at least as many as the open ranks (the admitted cap's condition)."""
        return len(self.live) >= len(ranks)
