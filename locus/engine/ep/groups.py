"""This rank's place in the expert-parallel topology and its process groups.

Ranks are node-major: rank r = node * G + local. Every *lane* has its own two tiers of sub-groups:
- tier 1, inter-node: the ranks with the same local index on every node (`node * G + local`);
- tier 2, intra-node: the G ranks of one node.
A lane is one stream of exchanges: without overlap there is one; `--ep-overlap` runs two
micro-batches at once, each on its own lane, so the collectives of one never queue behind (or
interleave with) the other's on a shared group. The control plane is one gloo group of every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from locus.engine.ep.loop_priority import lower_loop_threads


@dataclass
class TierGroups:
    """One lane's sub-groups (None where a tier has one member)."""

    inter: object | None
    intra: object | None


@dataclass
class Groups:
    rank: int
    nodes: int
    gpus_per_node: int
    lanes: list[TierGroups]
    control: object | None = None  # every rank, on gloo: step agreement, requests in, outputs out
    timeout: timedelta = field(default=timedelta(seconds=60))
    loop_nice: int = 0  # the nice value of gloo's event-loop threads (loop_priority.py), kept for a regroup

    def all(self) -> list:
        """Every process group held here (the lanes' tiers and the control group)."""
        held = [g for lane in self.lanes for g in (lane.inter, lane.intra)] + [self.control]
        return [g for g in held if g is not None]

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def node(self) -> int:
        return self.rank // self.gpus_per_node

    @property
    def local(self) -> int:
        return self.rank % self.gpus_per_node


def make_groups(nodes: int, gpus_per_node: int, lanes: int = 1, timeout: timedelta = timedelta(seconds=60),
                loop_nice: int = 0) -> Groups:
    """Create every lane's sub-groups and the control group, then set the gloo transport's event-loop
    threads to `loop_nice` (loop_priority.py; 0 leaves them). A collective call: every rank creates
    all of them, in one order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != nodes * gpus_per_node:
        raise ValueError(f"the process group has {world} ranks; the topology {nodes}x{gpus_per_node} needs {nodes * gpus_per_node}")
    made = []
    for _ in range(lanes):
        inter = intra = None
        for local in range(gpus_per_node):
            group = dist.new_group([n * gpus_per_node + local for n in range(nodes)], timeout=timeout)
            if nodes > 1 and local == rank % gpus_per_node:
                inter = group
        for node in range(nodes):
            group = dist.new_group([node * gpus_per_node + g for g in range(gpus_per_node)], timeout=timeout)
            if gpus_per_node > 1 and node == rank // gpus_per_node:
                intra = group
        made.append(TierGroups(inter, intra))
    control = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
    lower_loop_threads(loop_nice)  # the groups just made started new transport threads
    return Groups(rank, nodes, gpus_per_node, made, control, timeout, loop_nice)


def set_timeout(groups: Groups, timeout: timedelta) -> None:
    """Give every group of `groups`, and the default group, `timeout` for their collectives (groups are
    made under a longer start-up timeout, or a short one inside an elastic regroup)."""
    groups.timeout = timeout
    for group in [None, *groups.all()]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
