"""What rank 0 tells the server of an expert-parallel engine, read from its driver (driver.py): the
health of the ranks (started, serving, regrouping), each rank's counters as of its last report (what
/metrics shows per rank), the /ep/stats document, and the re-planner and admission log the server
hands requests and a recorded trace to. The server reads the driver through this view only
(`AsyncEngine` holds one under expert parallelism; tests/server/test_engine_interface.py checks).

Every read takes the driver's roster once: a regroup swaps it whole, so a reader in another thread (a
/metrics scrape, /health) never sees a lost rank both serving and lost.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace

from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.ranks.driver import EPDriver
from locus.engine.ep.ranks.stats import ep_stats_of
from locus.traces.format import Admission


@dataclass(frozen=True)
class EPHealth:
    started: int  # ranks the server started with
    serving: tuple[int, ...]  # the ranks serving now, named as the ranks they were started as
    recovering: bool  # the survivors of a lost rank are regrouping
    replanning: bool  # live re-planning is attached (POST /ep/replan may ask for a re-plan)

    @property
    def lost(self) -> list[int]:
        """The ranks started but serving no more, as the ranks they were started as."""
        return sorted(set(range(self.started)) - set(self.serving))


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's figures as of its last report (a lost rank's: as it last reported)."""

    identity: int  # the rank it was started as, which a regroup never renumbers
    counters: ExchangeCounters
    times: StepTimes
    tokens: int  # tokens it ran through the MoE layers


class EPView:
    """The server's read-only view of rank 0's driver, and the two hand-offs it needs (a re-plan request,
    the admission log of a recorded trace)."""

    def __init__(self, driver: EPDriver):
        self._driver = driver

    def health(self) -> EPHealth:
        driver = self._driver
        ranks, lost = driver.roster  # one read: a regroup swaps both at once
        return EPHealth(started=len(ranks) + len(lost), serving=tuple(r.identity for r in ranks),
                        recovering=driver.recovering, replanning=driver.replanner is not None)

    def ranks(self) -> list[RankSnapshot]:
        """Every rank that served, serving ones first in rank order, then the lost ones (their counts stay
        in every total: no counter runs backwards after a regroup)."""
        driver = self._driver
        ranks, lost = driver.roster
        return [RankSnapshot(r.identity, replace(r.counters), replace(r.times), driver.tokens_of(r))
                for r in ranks + lost]

    def stats(self) -> dict:
        """GET /ep/stats (stats.py)."""
        return ep_stats_of(self._driver)

    def request_replan(self, force: bool) -> Future:
        """Ask the re-planner for a re-plan now (replan.py: ReplanBusy when one is under way); the future
        holds its decision. Only when `health().replanning`."""
        return self._driver.replanner.request(force)

    def close(self) -> None:
        """After the engine stopped: the re-planner's temporary files go."""
        if self._driver.replanner is not None:
            self._driver.replanner.close()

    def admissions(self) -> dict[str, Admission] | None:
        """The order of admissions and releases, for merging the ranks' trace parts (None: not recording)."""
        log = self._driver.admissions
        return None if log is None else log.records


def ep_view_of(backend: object) -> EPView | None:
    """The view of `backend` when it is rank 0's driver of an expert-parallel engine, else None."""
    return EPView(backend) if isinstance(backend, EPDriver) else None
