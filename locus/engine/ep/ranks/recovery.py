"""Rank 0's side of elastic EP (`--ep-elastic`): after a lost rank, regroup with the survivors
(elastic.py) and put the driver's books in their numbering, so that no stream loses or repeats a token.

What it keeps across iterations: the commands of the iteration under way (resent to the survivors
when it fails: a survivor may not have them), the outputs read from a failed iteration's reports (out
with the next step's), and the requests the last regroup resumed from what they had streamed (the
survivors' reports read in the first iteration after it were made before it: a move's source may
report tokens of such a request that it will run again where it resumes, so that iteration drops
them).

A recovery, in order (`recover`):
    1. regroup: {old rank: new rank} of the survivors;
    2. read the reports that reached rank 0 in the failed iteration, in the old numbering, before
       anything resumes (a lost rank never sends its last one again, and a survivor whose own step of
       that iteration ran sends its next one instead);
    3. renumber: the ranks' records (lost ones kept as their last report left them), the queued
       commands, and the failed iteration's adds and aborts, resent;
    4. the failed iteration's moves: sent again with both ends alive, resumed on the target when the
       source was lost, dropped by the source when the target was (and resumed below);
    5. the survivors' requests keep their rank and charge it; each lost rank's request resumes on the
       least-loaded survivor from its prompt and what it streamed (preemption by recompute, across
       ranks), or fails when it cannot (n > 1, or lost after its last token).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from locus.engine.core.outputs import RequestOutput
from locus.engine.requests.sequence import Resumed
from locus.engine.ep.ranks.elastic import lost_peer
from locus.engine.ep.ranks.messages import Add, Commands, Move
from locus.errors import LocusError

if TYPE_CHECKING:
    from locus.engine.ep.ranks.driver import AdmittedRequest, EPDriver

log = logging.getLogger("locus.engine")


class Recovery:
    def __init__(self, driver: "EPDriver"):
        self.driver = driver
        self.enabled = driver.worker.elastic is not None
        self.resumed: set[str] = set()  # requests the last regroup resumed from what they had streamed
        self.sent: dict[int, Commands] = {}  # the commands of the iteration under way
        self.recovered: list[RequestOutput] = []  # read from a failed iteration's reports
        self.recovering = False  # a regroup is under way (/health says so)
        self.records: list[dict] = []  # what each recovery did (/ep/stats)
        self.stopping = threading.Event()  # the server is stopping: a regroup under way gives up
        if self.enabled:
            driver.worker.elastic.cancelled = self.stopping.is_set

    # --- around every iteration -------------------------------------------------------------------
    def sending(self, commands: dict[int, Commands]) -> None:
        """The iteration about to run sends `commands` (resent to the survivors if it fails)."""
        self.sent = commands

    def iteration_ran(self) -> tuple[set[str], list[RequestOutput]]:
        """The iteration ran: the requests whose tokens its reports must not deliver (resumed by the
        regroup before it), and the outputs read from the failed iteration before that regroup."""
        resumed, self.resumed = self.resumed, set()
        recovered, self.recovered = self.recovered, []
        return resumed, recovered

    def note(self, request: AdmittedRequest, out: RequestOutput) -> None:
        """Keep what a request has streamed: if its rank dies, a survivor resumes it from there."""
        if self.enabled:
            c = out.outputs[0]
            request.delivered.token_ids += c.delta_token_ids
            request.delivered.logprobs += c.delta_logprobs or []

    # --- a lost rank --------------------------------------------------------------------------------
    def recoverable(self, exc: BaseException) -> bool:
        """Whether a regroup may survive `exc`: a lost or hung peer, never a fault of rank 0's own or a
        disagreement between the ranks (elastic.lost_peer)."""
        return self.enabled and lost_peer(exc)

    def recover(self) -> bool:
        """A collective failed: regroup and resume (the module docstring's steps). False when not
        elastic, or when the regroup fails."""
        if not self.enabled:
            return False
        started, old_world = time.monotonic(), self.driver.world
        mapping = self._regroup()
        if mapping is None:
            return False
        self._read_failed_iteration()
        lost = [r for r in range(old_world) if r not in mapping]
        self._renumber(mapping, lost)
        self._resume_moves(mapping)
        self.sent = {}
        readmitted, failed = self._resume_lost(self._recharge(mapping))
        record = {"lost_ranks": lost, "survivors": self.driver.world, "readmitted": readmitted, "failed": failed,
                  "seconds": time.monotonic() - started, "epoch": self.driver.runtime.placement.epoch,
                  "topology": str(self.driver.runtime.placement.plan.topology)}
        self.records.append(record)
        log.warning("recovered from the loss of rank(s) %s in %.2f s: %d requests re-admitted, %d failed",
                    lost, record["seconds"], readmitted, failed)
        return True

    def _regroup(self) -> dict[int, int] | None:
        """Step 1 (every rank does its own): {old rank: new rank}, None when it failed. The survivors'
        plan has no grouping (the placement state regrouped): balanced admission from now on, and no
        grouper of the old plan is told about requests any more."""
        self.recovering = True
        try:
            mapping = self.driver.worker.regroup()
        except Exception as error:  # noqa: BLE001 - no way on: the caller fails the server
            if isinstance(error, LocusError):
                log.error("regrouping after a lost rank failed: %s", error)
            else:
                log.exception("regrouping after a lost rank failed")
            return None
        finally:
            self.recovering = False
        for request in self.driver.admitted.values():
            request.grouper = None
        return mapping

    def _read_failed_iteration(self) -> None:
        """Step 2. The outputs go out with the next step's (finished requests released now: none of them
        is resumed); the prefill signatures are dropped with the grouper they were for."""
        driver = self.driver
        outputs, _, moved = driver.read_reports(driver.worker.take_unread_reports(), self.resumed)
        driver.settle(outputs, moved)
        self.recovered += outputs

    def _renumber(self, mapping: dict[int, int], lost: list[int]) -> None:
        """Step 3. A re-plan made for the old membership is discarded, and no command of it (a window
        request, a move) reaches the survivors, queued or resent."""
        driver = self.driver
        driver.renumber_ranks(mapping, lost)
        if driver.replanner is not None:
            driver.replanner.membership_changed()
        driver.pending = {mapping[r]: replace(c, send_window=False, replan=None)
                          for r, c in driver.pending.items() if r in mapping}
        for r, c in self.sent.items():  # the failed iteration's: a survivor may not have them
            if r != 0 and r in mapping:
                resend = driver.command(mapping[r])
                resend.adds[:0] = [replace(a, retry=True) for a in c.adds if driver.rank_of(a.request_id) == r]
                resend.aborts[:0] = c.aborts

    def _resume_moves(self, mapping: dict[int, int]) -> None:
        """Step 4: with both ranks alive, sent again (the target ignores a request it holds already, the
        source resends what it sent); with the source lost, the target is told to resume the request
        from what it streamed unless it holds it; with the target lost, the source forgets it (step 5
        resumes it on a survivor, as any lost rank's request)."""
        driver = self.driver
        for source, c in self.sent.items():
            for m in c.moves_out:
                target, request = m.peer, driver.admitted.get(m.request_id)
                if request is None or request.rank != target:
                    continue  # finished since
                if source in mapping and target in mapping:
                    driver.command(mapping[source]).moves_out.insert(0, replace(m, peer=mapping[target], retry=True))
                    driver.command(mapping[target]).moves_in.insert(0, Move(m.request_id, mapping[source], m.number,
                                                                            True, request.charge))
                elif target in mapping:
                    driver.command(mapping[target]).adds.insert(0, resumed_add(m.request_id, request, retry=True))
                    self.resumed.add(m.request_id)
                elif source in mapping:
                    driver.command(mapping[source]).drops.append(m.request_id)

    def _recharge(self, mapping: dict[int, int]) -> list[str]:
        """Step 5, first half: the survivors' requests keep their rank (renumbered) and charge it; returns
        the lost ranks' requests, charged to no survivor until resumed."""
        driver, lost_requests = self.driver, []
        for record in driver.ranks:
            record.in_flight = 0
        for request_id, request in driver.admitted.items():
            if request.rank in mapping:
                request.rank = mapping[request.rank]
                driver.ranks[request.rank].in_flight += request.charge
            else:
                request.rank = None
                lost_requests.append(request_id)
        return lost_requests

    def _resume_lost(self, request_ids: list[str]) -> tuple[int, int]:
        """Step 5, second half: each lost rank's request to the least-loaded survivor, counted in the
        survivors' numbering (each one counts in the next one's choice). Returns (resumed, failed)."""
        resumed = sum(self._readmit(request_id) for request_id in request_ids)
        return resumed, len(request_ids) - resumed

    def _readmit(self, request_id: str) -> bool:
        """Re-add a lost rank's request on a survivor with what it streamed: the survivor recomputes
        prompt + streamed tokens and the stream goes on."""
        driver = self.driver
        request = driver.admitted[request_id]
        params = request.params
        if params.n != 1:
            driver.refuse(request_id, f"its rank was lost and a request with n = {params.n} cannot be resumed")
            return False
        if params.max_tokens is not None and len(request.delivered.token_ids) >= params.max_tokens:
            driver.refuse(request_id, "its rank was lost after its last token, before its final output")
            return False
        request.rank = driver.least_loaded()
        driver.ranks[request.rank].in_flight += request.charge
        driver.command(request.rank).adds.append(resumed_add(request_id, request))
        self.resumed.add(request_id)
        return True


def resumed_add(request_id: str, request: AdmittedRequest, retry: bool = False) -> Add:
    """The add that resumes `request` on a survivor from its prompt and what it streamed (preemption by
    recompute, across ranks); the add owns its copy of what was streamed."""
    resumed = Resumed(list(request.delivered.token_ids), list(request.delivered.logprobs))
    return Add(request_id, request.prompt, request.params, request.domain, resumed, retry=retry)
