"""A rank's report outbox (what a regroup resends) and its parked adds (waiting for a grammar to
compile): locus/engine/ep/ranks/outbox.py and parking.py, without processes."""

from __future__ import annotations

import threading
import time

from locus.engine.core.engine_core import EngineStats
from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.ranks.messages import Add, Report, unpack_reports
from locus.engine.ep.ranks.outbox import ReportOutbox
from locus.engine.ep.ranks.parking import ParkedAdds
from locus.engine.sampling.sampler import SamplingParams


def report(errors: list) -> Report:
    stats = EngineStats(*[0] * len(EngineStats.__dataclass_fields__))
    return Report([], errors, stats, ExchangeCounters(), StepTimes(), 0, None)


def sent(box: ReportOutbox) -> list[tuple[int, list]]:
    """(number, errors) of each report the next exchange carries."""
    return [(r.seq, r.errors) for r in unpack_reports(box.payload())] if box.payload() else []


def test_a_regroup_resends_the_reports_the_last_exchange_took_before_newer_ones():
    box = ReportOutbox()
    box.put(report([("a", "1")]))
    box.exchanged()
    assert sent(box) == []
    box.after_regroup()  # the failed exchange may have lost it: sent again, with its number
    assert sent(box) == [(1, [("a", "1")])]
    box.exchanged()
    # this rank's side of the exchange succeeded, rank 0's failed; this rank's step ran and packed its
    # next report before the regroup: both go, the older first (rank 0 drops the one it has read)
    box.put(report([("b", "2")]))
    box.after_regroup()
    assert sent(box) == [(1, [("a", "1")]), (2, [("b", "2")])]
    box.after_regroup()  # a second regroup before any exchange: nothing twice
    assert sent(box) == [(1, [("a", "1")]), (2, [("b", "2")])]
    box.exchanged()
    box.put(report([("c", "3")]))
    box.exchanged()
    box.after_regroup()
    assert sent(box) == [(3, [("c", "3")])]


def test_a_parked_add_comes_out_once_its_grammar_compiled_with_its_failure():
    release = threading.Event()

    def compile_grammar(spec):
        release.wait(10)
        if spec == "bad":
            raise ValueError("no output meets it")
        return spec

    parked = ParkedAdds(compile_grammar)
    adds = [Add(rid, [1], SamplingParams(max_tokens=2, structured=spec), None) for rid, spec in
            (("good", "g"), ("bad", "bad"), ("gone", "g"))]
    for add in adds:
        parked.park(add)
    assert parked.ready() == [] and "good" in parked
    assert parked.pop("gone") is adds[2] and parked.pop("gone") is None
    release.set()
    deadline, out = time.monotonic() + 10, []
    while len(out) < 2 and time.monotonic() < deadline:
        out += parked.ready()
        time.sleep(0.01)
    assert [(add.request_id, type(failure).__name__) for add, failure in out] == [("good", "NoneType"), ("bad", "ValueError")]
    assert "good" not in parked and parked.ready() == []
