"""Rank 0's driver keeps one record per rank and one per unfinished request (locus/engine/ep/ranks/
driver.py). After a regroup the records follow the survivors' numbering: a lost rank's request is
re-admitted to the least-loaded survivor counted in that numbering (on the old code it was picked from
the old ranks' loads indexed by new rank numbers), and a lost rank's record stays in every total (no
counter runs backwards). No process is launched: the worker is a stand-in
whose regroup returns the survivors' mapping."""

from __future__ import annotations

from dataclasses import asdict, fields
from types import SimpleNamespace

from locus.engine.core.engine_core import EngineStats, ValidatedRequest
from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.engine.requests.sequence import RequestMetrics
from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.ranks.driver import GAUGES, EPDriver
from locus.engine.ep.ranks.health import EPView
from locus.engine.ep.ranks.messages import Report, pack_output
from locus.engine.ep.ranks.worker import Iteration
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

    def take_unread_reports(self) -> dict:
        return {}  # (no iteration ran)


def admit(driver: EPDriver, request_id: str, charge: int) -> int:
    """Admit a one-token prompt charged `charge` tokens; the rank balanced admission chose."""
    return driver.add(request_id, ValidatedRequest([1], SamplingParams(max_tokens=charge - 1)), None)


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
    assert driver.add("n2", ValidatedRequest([1], SamplingParams(max_tokens=4, n=2)), None) == 3
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
    return {**stats_counters(ep_stats_of(driver)), **families_counters(ep_metrics(EPView(driver).ranks(), "tiny")), **engine}


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


# --- elastic EP: the reports that reached rank 0 in the iteration that failed ---------------------------
class ScriptedWorker(StandInWorker):
    """A stand-in whose iterations are scripted: each is {rank: [(request id, new token ids, finished)]},
    one report per rank numbered as its rank would; `fail=True`: those reports reach rank 0, then the
    iteration fails (a rank died in its step). `resend=rank`: that rank's last report arrives again, before
    the one it packed since, if any; `undelivered=rank`: that rank's report of this iteration is sent but
    never reaches rank 0."""

    def __init__(self, world: int, lost: list[int]):
        super().__init__(world, lost)
        self.times, self.last_move, self.seqs, self.sent, self.unread = StepTimes(), None, {}, {}, {}
        self.given: list[dict] = []  # the commands of each iteration
        self.core.stats = lambda: engine_stats(0)
        self.runtime.counters, self.runtime.counters_by_epoch = ExchangeCounters, dict

    def report(self, rank: int, outputs: list[tuple[str, list[int], bool]]) -> Report:
        self.seqs[rank] = self.seqs.get(rank, 0) + 1
        packed = [pack_output(RequestOutput(rid, [1], [CompletionOutput(0, "", ids if done else [], "", ids,
                                                                        finish_reason="length" if done else None)],
                                            done, RequestMetrics())) for rid, ids, done in outputs]
        self.sent[rank] = Report(packed, [], engine_stats(0), ExchangeCounters(), StepTimes(), 0, None,
                                 seq=self.seqs[rank])
        return self.sent[rank]

    def script(self, reports: dict[int, list], fail: bool = False, resend: tuple[int, ...] = (),
               undelivered: tuple[int, ...] = ()):
        previous = dict(self.sent)
        received = {rank: [self.report(rank, outputs)] for rank, outputs in reports.items()}
        for rank in resend:
            received[rank] = [previous[rank]] + received.get(rank, [])
        for rank in undelivered:  # packed and sent by that rank, never received by rank 0
            received.pop(rank, None)
        if fail:
            self.unread = received
            raise RuntimeError("Connection closed by peer")
        return Iteration(stop=False, stepped=True, reports=received)

    def take_unread_reports(self) -> dict[int, list[Report]]:
        unread, self.unread = self.unread, {}
        return unread


def streamed(outputs: list[RequestOutput]) -> dict[str, list[int]]:
    """What each request's client received, in order."""
    out: dict[str, list[int]] = {}
    for o in outputs:
        out.setdefault(o.request_id, []).extend(o.outputs[0].delta_token_ids)
    return out


def run(driver: EPDriver, worker: ScriptedWorker, script: list[dict]) -> dict[str, list[int]]:
    """Step the driver through `script` (each entry ScriptedWorker.script's arguments); a failed iteration
    is recovered from, as AsyncEngine does. Returns what every client received."""
    outputs = []
    for entry in script:
        worker.iterate = lambda commands=None, entry=entry: worker.given.append(commands) or worker.script(**entry)
        try:
            outputs += driver.step()
        except RuntimeError as exc:
            assert driver.recover(exc)
    return streamed(outputs)


def test_a_lost_ranks_tokens_that_reached_rank_0_in_the_failed_iteration_are_streamed_before_its_move_goes_on():
    """die-after-move's failure, in the driver: request d (rank 3) is moving to rank 1 when rank 3 dies in
    the step of that iteration; its second token came in the report rank 0 received in that iteration,
    and rank 1 holds the request with that token (the move went through). Rank 0 used to drop the report
    with the failed iteration: the client never got the token, and the resumed add (ignored by rank 1,
    which holds d) said one token had been streamed."""
    worker = ScriptedWorker(4, lost=[3])
    driver = EPDriver(worker)
    assert [admit(driver, rid, 20) for rid in "abcd"] == [0, 1, 2, 3]
    got = run(driver, worker, [{"reports": {3: [("d", [207], False)]}}])
    driver.move("d", 1)
    got2 = run(driver, worker, [{"reports": {3: [("d", [99], False)], 1: [("b", [5], False)]}, "fail": True}])
    assert driver.recoveries[-1]["lost_ranks"] == [3] and got2 == {}
    resumed = [a for a in driver.command(1).adds if a.request_id == "d"]
    assert [a.resumed.token_ids for a in resumed] == [[207, 99]]  # from every token d streamed
    # the survivors resend their last report (made before the failure): it was read already
    got3 = run(driver, worker, [{"reports": {}, "resend": (1,)}, {"reports": {1: [("d", [188], False)]}}])
    assert {rid: got.get(rid, []) + got3.get(rid, []) for rid in "bd"} == {"b": [5], "d": [207, 99, 188]}


def test_a_survivors_report_of_the_failed_iteration_is_streamed_when_its_next_report_follows():
    """The re-plan test's failure, in the driver: rank 1's step of the failed iteration ran (rank 2 died
    after its last exchange with rank 1), so after the regroup rank 1 sends its next report, not the one
    rank 0 received in the failed iteration: that report's token (b's 11) used to be lost mid-stream.
    Rank 2's request c resumes from every token it streamed, and one that finished in the lost rank's
    last report is not run again."""
    worker = ScriptedWorker(4, lost=[2])
    driver = EPDriver(worker)
    assert [admit(driver, rid, charge) for rid, charge in zip("abcde", (20, 20, 5, 20, 2))] == [0, 1, 2, 3, 2]
    got = run(driver, worker, [
        {"reports": {1: [("b", [10], False)], 2: [("c", [20], False)]}},
        {"reports": {1: [("b", [11], False)], 2: [("c", [21], False), ("e", [30], True)]}, "fail": True},
        {"reports": {1: [("b", [12], False)]}},
    ])
    assert got == {"b": [10, 11, 12], "c": [20, 21], "e": [30]}
    assert driver.recoveries[-1]["readmitted"] == 1 and "e" not in driver.requests()
    after = worker.given[2]  # the commands of the first iteration after the regroup
    assert [(a.request_id, a.resumed.token_ids) for c in after.values() for a in c.adds] == [("c", [20, 21])]


def test_a_report_lost_on_rank_0_s_side_of_the_exchange_is_read_before_the_survivor_s_next_one():
    """Rank 0's control exchange fails while rank 1's succeeds: rank 1 counts its report (b's 11) as
    sent, and its step of that iteration packs the next (b's 12) before the regroup. Rank 1 then sends
    both, the older first (outbox.py), and the client gets every token in order."""
    worker = ScriptedWorker(4, lost=[2])
    driver = EPDriver(worker)
    assert [admit(driver, rid, 20) for rid in "abcd"] == [0, 1, 2, 3]
    got = run(driver, worker, [
        {"reports": {1: [("b", [10], False)]}},
        {"reports": {1: [("b", [11], False)]}, "fail": True, "undelivered": (1,)},
        {"reports": {1: [("b", [12], False)]}, "resend": (1,)},
        {"reports": {1: [("b", [13], False)]}},
    ])
    assert got["b"] == [10, 11, 12, 13]
