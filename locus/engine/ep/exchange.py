"""Two-tier dispatch and combine of one MoE layer over torch.distributed (docs/design.md, "Expert-parallel
serving"; docs/expert_parallel.md).

Dispatch of a token held on rank s whose k chosen replicas sit in physical slots p_1..p_k:
1. tier 1: once to each remote node holding any of them, to the *proxy* there with s's local index,
   carrying the hidden state and the (slot, weight) pairs of that node;
2. tier 2: every rank sends each row it holds (its own tokens, and those it proxies) once to each
   other rank of its node that holds one of the row's slots, with those slots' pairs;
3. each rank runs its local experts on every (row, slot) pair that landed on it.
Combine runs back: partial sums return over tier 2 and are added on the holder, then over tier 1
and are added on the source.

One collective per tier and direction carries a row's hidden state and its routing metadata packed
into one byte row (`RowFormat`). How the rows travel is the transport's business (transport.py):
- `exact`: a small all-to-all of row counts first, then exactly the rows (at most 3 collectives a
  tier: rows and combine are point-to-point batches between the members that exchange something);
- `fixed`: every member's block has a capacity agreed for the step (the largest token count of any
  rank, DeepEP's low-latency layout): no size exchange and no host sync, padding rows on the wire
  (2 collectives a tier).
A rank with no tokens takes part with empty tensors (in every collective; exact's point-to-point
batches pair up from the counts), so no rank ever waits on one that skipped a layer.

Rows travel in the exchange's payload formats (`--ep-dispatch-format`, `--ep-combine-format`;
payload.py). A quantized dispatch encodes each of this rank's rows once, before tier 1, and its own
experts compute on the decoded rows too, so a token's output does not depend on where its experts
sit; a proxy forwards the bytes it received as they came (never re-encoded). A quantized combine
encodes each partial sum that travels.

Bytes are counted as docs/design.md defines them, by the sending rank: payload rows (H * dtype_bytes,
or the format's packed row), dispatch and combine each; tier 1 is the inter-node figure, tier 2 (own
and proxied rows) the intra-node one, counted by the source for its proxied rows too; routing
metadata apart; wire bytes (what was really sent, counted by the sender) apart again.

Shape legend: T tokens on this rank, K experts per token, H hidden, N rows held, M members of a
tier's group, C rows of capacity per member.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch

from locus.engine.ep.counters import DeviceTally, ExchangeCounters
from locus.engine.ep.groups import Groups, TierGroups
from locus.engine.ep.transport import RowFormat, Transport, hits

Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x [N,H], local slots [N,K], w [N,K]) -> [N,H]


class TwoTierExchange:
    """One lane's exchange: its sub-groups, its transport, its counters."""

    def __init__(self, groups: Groups, lane: TierGroups, transport: Transport, device: torch.device | str = "cpu",
                 dispatch_format: str = "model", combine_format: str = "model"):
        self.g, self.lane, self.transport = groups, lane, transport
        self.dispatch_format, self.combine_format = dispatch_format, combine_format
        self.counters = ExchangeCounters()
        self.tally = DeviceTally(device)

    def run(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, slots_per_gpu: int,
            compute: Compute, capacity: int) -> torch.Tensor:
        """x [T, H], slots [T, K] physical slots (-1 = none), weights [T, K] -> routed [T, H]: the
        sum over each token's pairs of its experts' outputs, wherever they ran. `capacity`: the
        step's largest token count on any rank (the fixed transport's block size)."""
        start, expert_before = time.perf_counter(), self.counters.expert_s
        g, S, G = self.g, slots_per_gpu, self.g.gpus_per_node
        T, K = slots.shape
        fmt = RowFormat(x.shape[1], K, x.dtype, self.dispatch_format, self.combine_format)
        self.counters.token_layers += T
        slot_node = slots // (S * G)  # -1 stays -1 (floor division)
        xb = fmt.dispatch.encode(x)  # [T, x_bytes] what travels
        if fmt.dispatch.quantized:
            x = fmt.dispatch.decode(xb)  # what every expert computes on, local ones included

        # Tier 1: one row per (token, remote node holding any of its slots), to that node's proxy.
        held_x, held_xb, held_slots, held_w = x, xb, slots.masked_fill(slot_node != g.node, -1), weights
        tier1 = None
        if self.lane.inter is not None:
            tier1 = self.transport.dispatch(xb, slots, weights, slot_node.masked_fill(slot_node == g.node, -1), g.nodes,
                                            self.lane.inter, fmt, capacity, "inter_node", self.counters, self.tally)
            arrived = tier1.slots.masked_fill(tier1.slots // (S * G) != g.node, -1)  # this node's pairs only
            held_x = torch.cat([x, tier1.x])
            held_xb = torch.cat([xb, tier1.encoded])
            held_slots = torch.cat([held_slots, arrived])
            held_w = torch.cat([weights, tier1.weights])

        # Tier 2: each held row once to each other rank of this node holding one of its slots.
        held_rank = held_slots // S
        mine = held_rank == g.rank
        out = self._compute(compute, held_x, (held_slots % S).masked_fill_(~mine, -1), held_w)
        if self.lane.intra is not None:
            self._count_intra_node(slots, S, fmt)
            others = (held_rank % G).masked_fill_(mine | (held_slots < 0), -1)
            cap2 = capacity * g.nodes  # own tokens plus what this rank proxies for every other node
            tier2 = self.transport.dispatch(held_xb, held_slots, held_w, others, G, self.lane.intra, fmt, cap2,
                                            "intra_node", self.counters, self.tally, payload=False)
            local = (tier2.slots % S).masked_fill_(tier2.slots // S != g.rank, -1)
            partial = self._compute(compute, tier2.x, local, tier2.weights)
            out = out + self.transport.combine(partial, tier2, self.lane.intra, "intra_node", self.counters)

        # Combine tier 1: proxied rows' sums return to their sources.
        if tier1 is not None:
            out = out[:T] + self.transport.combine(out[T:], tier1, self.lane.inter, "inter_node", self.counters)
        self.counters.exchange_s += time.perf_counter() - start - (self.counters.expert_s - expert_before)
        return out

    def _count_intra_node(self, slots: torch.Tensor, S: int, fmt: RowFormat) -> None:
        """Tier 2's payload, counted here, on the tokens' source rank, not by the rank that forwards a
        proxied row: every (token, destination rank) whose local index differs from this rank's (on
        this node the other ranks, on a remote node every rank but the proxy). Counted by the proxy, a
        token's bytes would reach rank 0's totals one report after its output did (a client reading
        /ep/stats on its last token could miss them)."""
        g = self.g
        dest = slots // S  # [T, K] destination ranks, -1: none
        other = (dest >= 0) & (dest % g.gpus_per_node != g.local)
        pairs = hits(dest.masked_fill(~other, -1), g.world).sum()
        self.tally.add("intra_node_bytes", pairs * fmt.x_bytes)
        self.tally.add("intra_node_combine_bytes", pairs * fmt.combine.nbytes)
        self.tally.add("metadata_bytes", pairs * fmt.meta_bytes)

    def _compute(self, compute: Compute, x: torch.Tensor, local_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = compute(x, local_slots, weights)
        self.tally.add("expert_pairs", (local_slots >= 0).sum())
        self.counters.expert_s += time.perf_counter() - start
        return out

    def mark(self) -> tuple[ExchangeCounters, dict[str, int]]:
        """What this lane has counted so far (host and device side), for `rewind`."""
        return replace(self.counters), self.tally.mark()

    def rewind(self, mark: tuple[ExchangeCounters, dict[str, int]]) -> None:
        """Forget what was counted since `mark`: a step that failed half-way (a lost peer) is run again
        after the regroup and counted then, so its first attempt must not count too."""
        counters, tally = mark
        self.counters = replace(counters)
        self.tally.rewind(tally)

    def drain(self) -> ExchangeCounters:
        """The counters, with the device-side row counts folded in (one host read)."""
        counts = self.tally.drain()
        c = self.counters
        for tier in ("inter_node", "intra_node"):  # dispatch and combine carry the same rows, each in its format
            setattr(c, f"{tier}_dispatch", getattr(c, f"{tier}_dispatch") + counts[f"{tier}_bytes"])
            setattr(c, f"{tier}_combine", getattr(c, f"{tier}_combine") + counts[f"{tier}_combine_bytes"])
        c.metadata += counts["metadata_bytes"]
        c.expert_pairs += counts["expert_pairs"]
        return c
