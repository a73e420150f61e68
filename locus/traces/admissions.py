"""AdmissionLog: the order in which an expert-parallel server's rank 0 admitted and released requests.

Rank 0 assigns every request to a rank when it arrives and frees the rank's charge when it finishes;
which rank a request gets depends on what was in flight at that moment. The log numbers admissions
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

    def _tick(self) -> int:
        self._next += 1
        return self._next - 1
