"""Several traces of one model -> one: what an expert-parallel server's ranks recorded, each of its
own requests, becomes one trace whose requests carry the rank they ran on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from locus.traces.format import TraceFormatError
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter


def _without_provenance(plan: dict) -> dict:
    """A plan as far as routing goes: two ranks may stamp one plan with different creation times."""
    return {k: v for k, v in plan.items() if k != "provenance"}


def merge_traces(sources: Sequence[str | Path], dst: str | Path, ranks: Sequence[int] | None = None) -> int:
    """Write the requests of every source trace, source by source, into a new trace at `dst`;
    with `ranks`, each source's requests are marked as run on ranks[i]. Returns the request count."""
    readers = [TraceReader(s) for s in sources]
    if not readers:
        raise TraceFormatError("merge: no source traces")
    meta = readers[0].meta
    for path, r in zip(sources, readers):
        if r.meta != meta:
            raise TraceFormatError(f"merge: {path} is a trace of {r.meta}, not {meta}")
    if ranks is not None and len(ranks) != len(readers):
        raise ValueError(f"merge: {len(ranks)} ranks for {len(readers)} traces")
    with_weights = all(r.expert_weights is not None for r in readers)
    with_epochs = any(r.epochs is not None for r in readers)  # a part without epochs ran in epoch 0
    writer = TraceWriter(Path(dst), meta, with_weights=with_weights, with_epochs=with_epochs)
    count = 0
    try:
        plans: dict[int, dict] = {}
        for path, r in zip(sources, readers):
            for epoch, plan in r.plans().items():
                if epoch not in plans:
                    plans[epoch] = plan
                    writer.add_plan(epoch, plan)
                elif _without_provenance(plans[epoch]) != _without_provenance(plan):
                    raise TraceFormatError(f"merge: {path} keeps another plan for epoch {epoch}")
        for i, r in enumerate(readers):
            offsets = np.asarray(r.offsets, dtype=np.int64)
            for j, record in enumerate(r.requests):
                lo, hi = int(offsets[j]), int(offsets[j + 1])
                if ranks is not None:
                    record = replace(record, rank=int(ranks[i]))
                weights = np.asarray(r.expert_weights[lo:hi]) if with_weights else None
                epochs = None
                if with_epochs:
                    epochs = np.asarray(r.epochs[lo:hi]) if r.epochs is not None else np.zeros(hi - lo, np.int32)
                writer.add_requests([record], np.asarray(r.expert_ids[lo:hi]), weights, epochs)
                count += 1
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return count
