"""Rank 0's driver keeps one record per rank and one per unfinished request (locus/engine/ep/ranks/
driver.py). After a regroup the records follow the survivors' numbering: a lost rank's request is
re-admitted to the least-loaded survivor counted in that numbering (on the old code it was picked from
the old ranks' loads indexed by new rank numbers). No process is launched: the worker is a stand-in
whose regroup returns the survivors' mapping."""

from __future__ import annotations

from types import SimpleNamespace

from locus.engine.ep.ranks.driver import EPDriver
from locus.engine.sampling.sampler import SamplingParams


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
