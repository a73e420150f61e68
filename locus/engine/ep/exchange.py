"""Two-tier dispatch and combine of one MoE layer over torch.distributed (DESIGN.md, "Expert-parallel
serving"; docs/expert_parallel.md).

Ranks are node-major: rank r = node * G + local. Two kinds of sub-group carry the traffic:
- tier 1, inter-node: the ranks with the same local index on every node (`node * G + local`);
- tier 2, intra-node: the G ranks of one node.

Dispatch of a token held on rank s whose k chosen replicas sit in physical slots p_1..p_k:
1. tier 1: once to each remote node holding any of them, to the *proxy* there with s's local index,
   carrying the hidden state and the (slot, weight) pairs of that node;
2. tier 2: every rank sends each row it holds (its own tokens, and those it proxies) once to each
   other rank of its node that holds one of the row's slots, with those slots' pairs;
3. each rank runs its local experts on every (row, slot) pair that landed on it.
Combine runs back: partial sums return over tier 2 and are added on the holder, then over tier 1
and are added on the source. All exchanges are `all_to_all_single`, sizes first; a rank with no
tokens takes part with empty tensors, so no rank ever waits on one that skipped a layer.

Bytes are counted as DESIGN.md defines them: payload rows of H * dtype_bytes, dispatch and combine
each; tier 1 is the inter-node figure, tier 2 (own and proxied rows) the intra-node one; routing
metadata (slot ids, weights, counts) apart.

Shape legend: T tokens on this rank, K experts per token, H hidden, M rows in an exchange.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M,H], local slots [M,K], w [M,K]) -> [M,H]


@dataclass
class ExchangeCounters:
    """What one rank's exchanges did: payload and metadata bytes it sent (dispatch and combine alike),
    the tokens it brought, the pairs its experts computed, and the time they took."""

    inter_node_dispatch: int = 0
    inter_node_combine: int = 0
    intra_node_dispatch: int = 0
    intra_node_combine: int = 0
    metadata: int = 0
    token_layers: int = 0  # (token, MoE layer) pairs that entered an exchange on this rank (own rows)
    expert_pairs: int = 0  # (row, slot) pairs this rank's experts computed: its expert load, summed over layers
    exchange_s: float = 0.0  # wall time inside run(), less the local expert compute: moving rows and waiting
    expert_s: float = 0.0  # wall time of the local expert compute (on CUDA: launch time, no sync is forced)

    @property
    def inter_node(self) -> int:
        return self.inter_node_dispatch + self.inter_node_combine

    @property
    def intra_node(self) -> int:
        return self.intra_node_dispatch + self.intra_node_combine


@dataclass
class _Route:
    """How rows went out of one all_to_all, to send values for them back."""

    order: torch.Tensor  # [M] the sent rows, sorted by destination member
    sent: list[int]
    received: list[int]


@dataclass
class Groups:
    """This rank's place in the topology and its two sub-groups (None where a tier has one member)."""

    rank: int
    nodes: int
    gpus_per_node: int
    slots_per_gpu: int
    inter: object | None  # tier-1 group: node * G + local for every node
    intra: object | None  # tier-2 group: this node's ranks
    control: object | None = None  # every rank, on gloo: step agreement, requests in, outputs out
    timeout: timedelta = field(default=timedelta(seconds=60))

    @property
    def node(self) -> int:
        return self.rank // self.gpus_per_node

    @property
    def local(self) -> int:
        return self.rank % self.gpus_per_node


def make_groups(nodes: int, gpus_per_node: int, slots_per_gpu: int, timeout: timedelta = timedelta(seconds=60)) -> Groups:
    """Create every tier's sub-groups (a collective call: every rank makes all of them, in one order)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != nodes * gpus_per_node:
        raise ValueError(f"the process group has {world} ranks; the topology {nodes}x{gpus_per_node} needs {nodes * gpus_per_node}")
    inter = intra = None
    for local in range(gpus_per_node):
        group = dist.new_group([n * gpus_per_node + local for n in range(nodes)], timeout=timeout)
        if nodes > 1 and local == rank % gpus_per_node:
            inter = group
    for node in range(nodes):
        group = dist.new_group([node * gpus_per_node + g for g in range(gpus_per_node)], timeout=timeout)
        if gpus_per_node > 1 and node == rank // gpus_per_node:
            intra = group
    control = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
    return Groups(rank, nodes, gpus_per_node, slots_per_gpu, inter, intra, control, timeout)


def send_rows(tensors: list[torch.Tensor], member: torch.Tensor, group, size: int) -> tuple[list[torch.Tensor], _Route]:
    """Send row i of every tensor to group member member[i]; returns the rows received (grouped by
    sender, in the senders' order) and the route to send values back along."""
    order = torch.argsort(member, stable=True)
    sent_counts = torch.bincount(member, minlength=size).to(torch.int64)
    received_counts = torch.empty_like(sent_counts)
    dist.all_to_all_single(received_counts, sent_counts, group=group)
    sent, received = sent_counts.tolist(), received_counts.tolist()
    out = []
    for t in tensors:
        buf = t.new_empty((sum(received), *t.shape[1:]))
        dist.all_to_all_single(buf, t[order].contiguous(), received, sent, group=group)
        out.append(buf)
    return out, _Route(order, sent, received)


def send_back(values: torch.Tensor, route: _Route, group) -> torch.Tensor:
    """Values for the rows a send_rows delivered here -> back to their senders, aligned with the
    rows each sender sent (its original order)."""
    buf = values.new_empty((sum(route.sent), *values.shape[1:]))
    dist.all_to_all_single(buf, values.contiguous(), route.sent, route.received, group=group)
    out = torch.empty_like(buf)
    out[route.order] = buf
    return out


class TwoTierExchange:
    def __init__(self, groups: Groups):
        self.g = groups
        self.counters = ExchangeCounters()

    def run(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, compute: Compute) -> torch.Tensor:
        """x [T, H], slots [T, K] physical slots (-1 = none), weights [T, K] -> routed [T, H]: the
        sum over each token's pairs of its experts' outputs, wherever they ran."""
        start, expert_before = time.perf_counter(), self.counters.expert_s
        g = self.g
        S, G = g.slots_per_gpu, g.gpus_per_node
        row_bytes = x.shape[1] * x.element_size()
        self.counters.token_layers += x.shape[0]
        slot_node = torch.where(slots >= 0, slots // S // G, -1)

        # Tier 1: one row per (token, remote node holding any of its slots), to that node's proxy.
        own = self._keep(slots, slot_node == g.node)
        held_x, held_slots, held_w = x, own, weights
        if g.inter is not None:
            remote = (slot_node >= 0) & (slot_node != g.node)
            token, node = self._pairs_per_group(slot_node, remote, g.nodes)
            t1_slots = self._keep(slots[token], slot_node[token] == node[:, None])
            (px, pslots, pw), route1 = send_rows([x[token], t1_slots, weights[token]], node, g.inter, g.nodes)
            self.counters.inter_node_dispatch += len(token) * row_bytes
            self.counters.metadata += len(token) * slots.shape[1] * (4 + weights.element_size())
            held_x = torch.cat([x, px])
            held_slots = torch.cat([own, pslots])
            held_w = torch.cat([weights, pw])

        # Tier 2: each held row once to each other rank of this node holding one of its slots.
        slot_rank = torch.where(held_slots >= 0, held_slots // S, -1)
        mine = self._keep(held_slots, slot_rank == g.rank)
        out = self._compute(compute, held_x, torch.where(mine >= 0, mine % S, -1), held_w)
        if g.intra is not None:
            other = (slot_rank >= 0) & (slot_rank != g.rank)
            local_of = torch.where(slot_rank >= 0, slot_rank % G, -1)
            row, member = self._pairs_per_group(local_of, other, G)
            t2_slots = self._keep(held_slots[row], local_of[row] == member[:, None])
            (rx, rslots, rw), route2 = send_rows([held_x[row], t2_slots, held_w[row]], member, g.intra, G)
            self.counters.intra_node_dispatch += len(row) * row_bytes
            self.counters.metadata += len(row) * slots.shape[1] * (4 + weights.element_size())
            partial = self._compute(compute, rx, torch.where(rslots >= 0, rslots % S, -1), rw)
            back = send_back(partial, route2, g.intra)
            self.counters.intra_node_combine += len(row) * row_bytes
            out = out.index_add(0, row, back)

        # Combine tier 1: proxied rows' sums return to their sources.
        if g.inter is not None:
            T = x.shape[0]
            back = send_back(out[T:], route1, g.inter)
            self.counters.inter_node_combine += len(token) * row_bytes
            out = out[:T].index_add(0, token, back)
        self.counters.exchange_s += time.perf_counter() - start - (self.counters.expert_s - expert_before)
        return out

    def _compute(self, compute: Compute, x: torch.Tensor, local_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = compute(x, local_slots, weights)
        self.counters.expert_pairs += int((local_slots >= 0).sum())
        self.counters.expert_s += time.perf_counter() - start
        return out

    @staticmethod
    def _keep(slots: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return torch.where(where, slots, -1)

    @staticmethod
    def _pairs_per_group(member_of_slot: torch.Tensor, wanted: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, member) once per distinct member among each row's wanted slots, rows ascending."""
        hit = torch.zeros((member_of_slot.shape[0], size), dtype=torch.bool, device=member_of_slot.device)
        rows = torch.arange(member_of_slot.shape[0], device=member_of_slot.device)[:, None].expand_as(member_of_slot)
        hit[rows[wanted], member_of_slot[wanted]] = True
        row, member = hit.nonzero(as_tuple=True)
        return row, member
