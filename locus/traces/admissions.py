"""AdmissionLog: the order in which an expert-parallel server's rank 0 admitted and released requests.

Rank 0 assigns every request to a rank when it arrives and frees the rank's charge when it finishes;
which rank a request gets depends on what was in flight at that moment. With moves after prefill
(--ep-moves) it also logs when it offered each request's prefill signature to the grouper, and where
a request moved and how many KV positions went with it. The log numbers admissions
and releases on one counter, so a recorded trace can carry, per request, where its admission and its
release fell (RequestRecord.admitted / .released) and what it was charged, and the replay can run the
grouper through the same sequence of events (locus/routing/grouping/live.py).
"""

from __future__ import annotations

from dataclasses import replace

from locus.traces.format import Admission


class AdmissionLog:
    def __init__(self) -> None:
        self._next = 0
        self.records: dict[str, Admission] = {}

    def admit(self, request_id: str, charge: int) -> None:
        self.records[request_id] = Admission(self._tick(), None, int(charge))

    def release(self, request_id: str) -> None:
        found = self.records.get(request_id)
        if found is not None and found.released is None:
            self.records[request_id] = replace(found, released=self._tick())

    def observe(self, request_id: str) -> None:
        """Rank 0 offered the request's prefill signature to the grouper (which may move it)."""
        found = self.records.get(request_id)
        if found is not None and found.observed is None:
            self.records[request_id] = replace(found, observed=self._tick())

    def moved(self, request_id: str, source: int, target: int) -> None:
        """The grouper moved the request after its prefill from rank `source` to `target`."""
        found = self.records.get(request_id)
        if found is not None:
            self.records[request_id] = replace(found, prefill_rank=int(source), decode_rank=int(target))

    def moved_tokens(self, request_id: str, tokens: int) -> None:
        """The KV positions the move sent (what the source had computed when the move reached it)."""
        found = self.records.get(request_id)
        if found is not None:
            self.records[request_id] = replace(found, moved_tokens=int(tokens))

    def _tick(self) -> int:
        self._next += 1
        return self._next - 1
