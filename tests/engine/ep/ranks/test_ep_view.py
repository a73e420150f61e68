"""What the server reads of rank 0's driver (locus/engine/ep/ranks/health.py), across a regroup: the ranks
started and serving (named as started) and the lost ones, and every rank's last figures, the lost rank's
kept. The driver's worker is test_driver_records.py's stand-in, whose regroup loses the ranks it names."""

from __future__ import annotations

from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.ranks.driver import EPDriver
from locus.engine.ep.ranks.health import EPHealth, EPView
from tests.engine.ep.ranks.test_driver_records import StandInWorker


def test_health_names_the_lost_rank_as_started_and_the_figures_keep_it():
    worker = StandInWorker(4, lost=[1])
    worker.runtime.layers = [object()]  # one MoE layer: a rank's tokens are its token-layers
    driver = EPDriver(worker)
    view = EPView(driver)
    for rank, n in enumerate((40, 30, 20, 10)):
        driver.ranks[rank].counters = ExchangeCounters(token_layers=n)
        driver.ranks[rank].times = StepTimes(steps=n)
    assert view.health() == EPHealth(started=4, serving=(0, 1, 2, 3), recovering=False, replanning=False)
    assert view.health().lost == []
    before = view.ranks()
    assert [(r.identity, r.tokens, r.times.steps) for r in before] == [(0, 40, 40), (1, 30, 30), (2, 20, 20), (3, 10, 10)]
    assert driver.recover(RuntimeError("rank 1 lost"))
    health = view.health()
    assert health.serving == (0, 2, 3) and health.started == 4 and health.lost == [1] and not health.recovering
    # serving ranks first (renumbered 0, 1, 2, named as started), then the lost one as it last reported
    assert [(r.identity, r.tokens) for r in view.ranks()] == [(0, 40), (2, 20), (3, 10), (1, 30)]
    driver.ranks[0].times.steps += 1  # a snapshot is a copy: the driver's next report does not change it
    assert before[0].times.steps == 40


def test_health_says_recovering_while_the_survivors_regroup():
    driver = EPDriver(StandInWorker(2, lost=[1]))
    seen = []
    worker = driver.worker
    regroup = worker.regroup
    worker.regroup = lambda: (seen.append(EPView(driver).health()), regroup())[1]
    assert driver.recover(RuntimeError("rank 1 lost"))
    assert [h.recovering for h in seen] == [True] and not EPView(driver).health().recovering
