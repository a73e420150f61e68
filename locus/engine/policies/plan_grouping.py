"""PlanGrouping: the engine's GroupingPolicy backed by the placement plan's micro-batch grouper.

Micro-batch i is node i: every scheduled sequence goes to the micro-batch of the node its request was
placed on (locus.routing.grouping.grouper.Grouper: domain tag at admission, else the plan's prompt
predictor; expert signature after prefill).
When the engine runs fewer micro-batches than the plan has nodes, node n goes to micro-batch
n * num_micro_batches // nodes. Empty micro-batches are dropped (the engine runs every one it gets);
`last_nodes` says which node(s) each returned micro-batch holds.

Wiring: `EngineCore(..., grouping=policy)`, plus `core.routing.subscribe(policy.observe)`, so that
the prompt's routing reaches the grouper once the prefill
(possibly chunked over several steps) completes. Without the observer the grouper still places
requests by domain. A finished request is released at the next `group` call.
"""

from __future__ import annotations

import numpy as np

from locus.engine.requests.sequence import ScheduledSeq
from locus.engine.observers.routing_tap import StepRouting
from locus.traces.counts import count_expert_ids
from locus.routing.grouping.grouper import Grouper


class PlanGrouping:
    def __init__(self, grouper: Grouper, moe_layers, num_experts: int):
        self.grouper = grouper
        self.layers = tuple(int(x) for x in moe_layers)
        self.num_experts = int(num_experts)
        self._requests: dict[str, object] = {}  # request id -> Request (to notice when it finishes)
        self._prefill: dict[str, np.ndarray] = {}  # request id -> prompt pair counts so far [L, E]
        self.last_ranks: list[list[int]] = []  # per returned micro-batch: the ranks its requests run on
        self.last_nodes: list[list[int]] = []  # the same, as nodes

    @classmethod
    def from_plan(cls, plan, moe_layers, attention_cap: float | None = None, model_config=None) -> "PlanGrouping":
        """`moe_layers`: the model's MoE layers, in the order the routing is reported. With the model's
        config, the plan's prompt predictor (if any) places untagged requests (refused if it was
        learned for another model)."""
        grouper = Grouper.from_plan(plan, attention_cap=attention_cap, moe_layers=moe_layers,
                                    predictor=model_config is not None)
        if grouper.predictor is not None:
            grouper.predictor.check_model(model_config.vocab_size, model_config.moe_layers,
                                          model_config.num_local_experts)
        return cls(grouper, moe_layers, plan.num_experts)

    def group(self, items: list[ScheduledSeq], num_micro_batches: int) -> list[list[ScheduledSeq]]:
        self._release_finished()
        topology = self.grouper.topology
        k = max(1, num_micro_batches)
        groups: list[list[ScheduledSeq]] = [[] for _ in range(k)]
        held: list[set[int]] = [set() for _ in range(k)]
        for item in items:
            rank = self.rank_of(self._admit(item))
            mb = topology.node_of(rank) * k // topology.nodes
            groups[mb].append(item)
            held[mb].add(rank)
        self.last_ranks = [sorted(h) for g, h in zip(groups, held) if g]
        self.last_nodes = [sorted({topology.node_of(r) for r in ranks}) for ranks in self.last_ranks]
        return [g for g in groups if g]

    def rank_of(self, request_id: str) -> int:
        """The rank the grouper gave the request (its attention runs there; expert parallelism
        starts its tokens there at every MoE layer)."""
        return self.grouper.rank_of(request_id)

    def observe(self, step: StepRouting) -> None:
        """A routing-tap subscriber: add this step's prompt rows to each request's signature; when a
        request's prompt is complete, hand the signature to the grouper (a move, if any, applies
        from the next step)."""
        ids = step.ids  # [T, L, K], the model's MoE layers in order
        for item, (span, lo, hi) in zip(step.items, step.rows):
            rid = item.seq.request.request_id
            if rid not in self._prefill:
                continue
            prompt = len(item.seq.prompt_ids)
            rows = min(hi, lo + max(prompt - span.start, 0))  # the rows of this step that are prompt tokens
            counts = self._prefill[rid]
            counts += count_expert_ids(ids[lo:rows], self.num_experts)
            if span.start + (hi - lo) >= prompt:
                self.grouper.observe_prefill(rid, counts)
                del self._prefill[rid]

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._prefill.pop(request_id, None)
        self.grouper.finish(request_id)

    def _admit(self, item: ScheduledSeq) -> str:
        request = item.seq.request
        rid = request.request_id
        if rid not in self._requests:
            prompt_ids = getattr(item.seq, "prompt_ids", None) or None
            prompt = len(prompt_ids or ()) or item.num_tokens
            expected = prompt + self.grouper.spec.expected_decode_tokens
            self.grouper.admit(rid, getattr(request, "domain", None), expected, prompt_tokens=prompt, prompt_ids=prompt_ids)
            self._requests[rid] = request
            self._prefill[rid] = np.zeros((len(self.layers), self.num_experts), dtype=np.float32)
        return rid

    def _release_finished(self) -> None:
        for rid in [r for r, req in self._requests.items() if getattr(req, "finished", False)]:
            self.release(rid)
