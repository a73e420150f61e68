"""Several traces of one model -> one: what an expert-parallel server's ranks recorded, each of its
own requests, becomes one trace whose requests carry the rank they ran on."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from locus.traces.format import Admission, TraceFormatError
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter


def _without_provenance(plan: dict) -> dict:
    """A plan as far as routing goes: two ranks may stamp one plan with different creation times."""
    return {k: v for k, v in plan.items() if k != "provenance"}


def merge_traces(sources: Sequence[str | Path], dst: str | Path, ranks: Sequence[int] | None = None,
                 admissions: Mapping[str, Admission] | None = None) -> int:
    """Write the requests of every source trace, source by source, into a new trace at `dst`;
    with `ranks`, each source's requests are marked as run on ranks[i]. With `admissions` (what rank 0
    admitted, by request id: a choice `id#i` of an n > 1 request takes its request's), the requests
    carry their admission and are written in admission order. Returns the request count."""
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
    with_tokens = all(r.token_ids is not None for r in readers)
    writer = TraceWriter(Path(dst), meta, with_weights=with_weights, with_epochs=with_epochs, with_tokens=with_tokens)
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
        order = [(i, j) for i, r in enumerate(readers) for j in range(len(r.requests))]
        if admissions:
            order.sort(key=lambda ij: _admitted(readers[ij[0]].requests[ij[1]].id, admissions))
        for i, j in order:
            r = readers[i]
            lo, hi = int(r.offsets[j]), int(r.offsets[j + 1])
            record = r.requests[j]
            if ranks is not None:
                record = replace(record, rank=int(ranks[i]))
            if admissions:
                admission = _admission_of(record.id, admissions)
                if admission is not None:
                    record = replace(record, admitted=admission.admitted, released=admission.released,
                                     charge=admission.charge, observed=admission.observed)
                    if admission.decode_rank is not None and admission.moved_tokens is not None:
                        # moved after its prefill: its part is the target's; its prefill ran on the source
                        record = replace(record, rank=admission.prefill_rank, decode_rank=admission.decode_rank,
                                         moved_tokens=admission.moved_tokens)
            weights = np.asarray(r.expert_weights[lo:hi]) if with_weights else None
            epochs = None
            if with_epochs:
                epochs = np.asarray(r.epochs[lo:hi]) if r.epochs is not None else np.zeros(hi - lo, np.int32)
            tokens = np.asarray(r.token_ids[lo:hi]) if with_tokens else None
            writer.add_requests([record], np.asarray(r.expert_ids[lo:hi]), weights, epochs, tokens)
            count += 1
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return count


def _admission_of(request_id: str, admissions: Mapping[str, Admission]) -> Admission | None:
    """The admission of a trace request: its own, else (a choice `id#i` of an n > 1 request) its request's."""
    found = admissions.get(request_id)
    if found is None and "#" in request_id:
        found = admissions.get(request_id.rsplit("#", 1)[0])
    return found


def _admitted(request_id: str, admissions: Mapping[str, Admission]) -> tuple[int, int]:
    """Sort key: admitted requests in admission order, then the others (none, normally) as they come."""
    found = _admission_of(request_id, admissions)
    return (0, found.admitted) if found is not None else (1, 0)
