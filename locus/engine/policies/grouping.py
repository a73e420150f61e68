"""Micro-batch grouping policies: which scheduled sequences share a micro-batch.

A step's batch is split into micro-batches (with expert parallelism, one per node or overlap
stage). The policy is pluggable: the default keeps arrival order; the trace-driven grouper of the
planner puts sequences with similar expert usage together.
"""

from __future__ import annotations

from typing import Protocol

from locus.engine.requests.sequence import ScheduledSeq


class GroupingPolicy(Protocol):
    def group(self, items: list[ScheduledSeq], num_micro_batches: int) -> list[list[ScheduledSeq]]: ...


class FirstComeGrouping:
    """Contiguous runs in scheduling order, cut so that token counts are as even as possible."""

    def group(self, items: list[ScheduledSeq], num_micro_batches: int) -> list[list[ScheduledSeq]]:
        if num_micro_batches <= 1 or len(items) <= 1:
            return [items] if items else []
        total = sum(i.num_tokens for i in items)
        target = total / min(num_micro_batches, len(items))
        groups: list[list[ScheduledSeq]] = [[]]
        acc = 0
        for item in items:
            if groups[-1] and acc >= target * len(groups) and len(groups) < num_micro_batches:
                groups.append([])
            groups[-1].append(item)
            acc += item.num_tokens
        return groups
