"""Rank 0's driver keeps one record per rank and one per unfinished request (locus/engine/ep/ranks/
driver.py). After a regroup the records follow the survivors' numbering: a lost rank's request is
re-admitted to the least-loaded survivor counted in that numbering (on the old code it was picked from
the old ranks' loads indexed by new rank numbers), and a lost rank's record stays in every total (no
counter runs backwards). No process is launched: the worker is a stand-in
whose regroup returns the survivors' mapping."""

from __future__ import annotations

from dataclasses import asdict, fields
from types import SimpleNamespace

from locus.engine.core.engine_core import EngineStats
from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.ranks.driver import GAUGES, EPDriver
from locus.engine.ep.ranks.stats import ep_stats_of
from locus.engine.sampling.sampler import SamplingParams
from locus.routing.plan.topology import Topology
from locus.server.metrics import ep_metrics
from tests.engine.ep.counter_checks import assert_never_backwards, closed_epochs, families_counters, stats_counters


class StandInWorker:
    """What EPDriver reads of rank 0's RankWorker, with a regroup that loses the ranks in `lost`."""

    def __init__(self, world: int, lost: list[int]):
        self.world, self.lost, self.expert_bytes = world, lost, 0
        self.signatures, self.members = None, list(range(world))
        self.elastic = SimpleNamespace(cancelled=None)
        config = SimpleNamespace(moe_layers=(0,), num_experts=4)
        self.core = SimpleNamespace(model=SimpleNamespace(config=config), expert_load=None, recorder=None,
                                    max_model_len=4096, pool_tokens=1 << 20)
        plan = SimpleNamespace(grouping=None, topology="1x4")  # balanced admission
        self.runtime = SimpleNamespace(placement=SimpleNamespace(plan=plan, epoch=0), layers=[],
                                       state=SimpleNamespace(grouping_plan=None))

    def regroup(self) -> dict[int, int]:
        survivors = [r for r in range(self.world) if r not in self.lost]
        self.members = survivors
        return {old: new for new, old in enumerate(survivors)}


def admit(driver: EPDriver, request_id: str, charge: int) -> int:
    """Admit a one-token prompt charged `charge` tokens; the rank balanced admission chose."""
    return driver.add(request_id, [1], SamplingParams(max_tokens=charge - 1), None)


def readmitted_to(driver: EPDriver) -> dict[str, int]:
    """{request id: rank} of the adds queued that resume a request from what it streamed."""
    return {a.request_id: rank for rank in range(driver.world) for a in driver.command(rank).adds
            if a.resumed is not None}


def test_a_lost_ranks_request_goes_to_the_least_loaded_survivor_in_the_survivors_numbering():
    driver = EPDriver(StandInWorker(4, lost=[2]))
    # balanced admission: one request a rank, in rank order; rank 3 is by far the most loaded
    assert [admit(driver, rid, charge) for rid, charge in (("a", 10), ("b", 100), ("c", 5), ("d", 1000))] == [0, 1, 2, 3]
    assert driver.recover(RuntimeError("rank 2 lost"))
    # survivors 0, 1, 3 are now 0, 1, 2 with 10, 100 and 1000 tokens in flight: "c" goes to rank 0,
    # not to new rank 2 (old rank 3, the busiest), which the old ranks' loads [10, 100, 5, ...] named
    assert readmitted_to(driver) == {"c": 0}
    assert driver.world == 3 and driver.recoveries[-1]["readmitted"] == 1


def test_each_readmitted_request_counts_in_the_next_ones_choice():
    driver = EPDriver(StandInWorker(4, lost=[0, 1]))
    for rid, charge in (("a", 50), ("b", 50), ("c", 10), ("d", 20)):
        admit(driver, rid, charge)
    assert driver.recover(RuntimeError("ranks 0 and 1 lost"))
    # survivors 2, 3 are now 0, 1 (10 and 20 tokens): "a" to rank 0 (10 -> 60), then "b" to rank 1
    assert readmitted_to(driver) == {"a": 0, "b": 1}
    assert [r.in_flight for r in driver.ranks] == [60, 70]
    assert [driver.rank_of(rid) for rid in "abcd"] == [0, 1, 0, 1]


def test_a_lost_request_that_cannot_resume_fails_and_leaves_the_survivors_counts_alone():
    driver = EPDriver(StandInWorker(4, lost=[3]))
    for rid, charge in (("a", 10), ("b", 20), ("c", 30)):
        admit(driver, rid, charge)
    assert driver.add("n2", [1], SamplingParams(max_tokens=4, n=2), None) == 3
    assert driver.recover(RuntimeError("rank 3 lost"))
    assert driver.take_refused() == [("n2", "its rank was lost and a request with n = 2 cannot be resumed")]
    assert [r.in_flight for r in driver.ranks] == [10, 20, 30] and driver.requests() == ["a", "b", "c"]


# --- issue 55, item 2: no counter runs backwards after a regroup ---------------------------------------
def counted(n: int) -> ExchangeCounters:
    """Exchange counters with every field `n` (distinct per rank, so a renumbering shows)."""
    return ExchangeCounters(*[n] * len(fields(ExchangeCounters)))


def engine_stats(n: int) -> EngineStats:
    return EngineStats(*[n] * len(fields(EngineStats)))


def every_counter(driver: EPDriver) -> dict[str, float]:
    """/ep/stats' and /metrics' EP counters, and the engine counters /metrics sums over ranks."""
    engine = {f"engine {k}": v for k, v in asdict(driver.stats()).items() if k not in GAUGES}
    return {**stats_counters(ep_stats_of(driver)), **families_counters(ep_metrics(driver, "tiny")), **engine}


def test_no_counter_of_ep_stats_or_metrics_runs_backwards_after_a_regroup():
    """SIGKILL of rank 2 of 4, idle: the totals of /ep/stats, its epoch-0 entry and locus_ep_bytes_total
    went down (only the lost rank's bytes were kept, as `retired`, outside every total), the engine
    counters /metrics sums over ranks lost the rank's share, and per-rank series, labelled with the
    new rank numbers, showed rank 3's counts as rank 2's (fewer)."""
    worker = StandInWorker(4, lost=[2])
    worker.runtime.mode, worker.runtime.overlap = "exact", False
    worker.runtime.placement.plan.topology = Topology(2, 2, 2)
    driver = EPDriver(worker)
    for rank, n in enumerate((40, 30, 20, 10)):  # the lost rank counted more than the one renumbered in its place
        record = driver.ranks[rank]
        record.counters, record.epochs, record.stats = counted(n), {0: counted(n)}, engine_stats(n)
        record.times = StepTimes(steps=n, step_s=3.0 * n, control_s=float(n), exchange_s=float(n))
    before, epochs_before = every_counter(driver), ep_stats_of(driver)["epochs"]
    assert driver.recover(RuntimeError("rank 2 lost"))
    worker.runtime.placement.epoch = 1  # the survivors' placement (what the regroup made)
    after = every_counter(driver)
    assert_never_backwards(before, after)
    assert after == before  # nothing ran since: every figure is what it was
    stats = ep_stats_of(driver)
    assert closed_epochs(stats) == {0: epochs_before[0]}
    assert [r["identity"] for r in stats["per_rank"]] == [0, 1, 3] and [r["rank"] for r in stats["per_rank"]] == [0, 1, 2]
    assert [r["identity"] for r in stats["retired"]["per_rank"]] == [2]
    assert stats["retired"]["inter_node_bytes"] == 2 * 20 and stats["inter_node_bytes"] == 2 * (40 + 30 + 20 + 10)
    assert driver.tokens_run() == 40 + 30 + 20 + 10  # (one MoE layer)
