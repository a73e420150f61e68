"""bench/locality_bound.py: its crossing count equals the replay of the recorded assignment, and its
hindsight bounds are no worse than what the plan sent."""

import json

import numpy as np
import pytest

from locus.routing.plan.topology import Topology
from locus.routing.planners.planner import make_plan
from locus.routing.replay.assignment import Assignment
from locus.routing.replay.simulator import replay
from locus.traces.format import RequestRecord, TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

from tests.bench.bench_scripts import run_bench


@pytest.mark.slow  # an exhaustive placement search in a subprocess: about a minute on two shared cores
def test_locality_bound_counts_what_the_replay_counts(tmp_path):
    rng = np.random.default_rng(0)
    meta = TraceMeta("toy", 8, 1, (1, 3), hidden_size=32, dtype_bytes=2)
    domains = ("a", "b", "c", "d")
    prefs = rng.dirichlet(np.full(8, 0.5), size=(4, 2))  # [domain, layer, E]

    def write(path, count, ranks=None):
        records, rows = [], []
        for i in range(count):
            d = i % 4
            ids = np.stack([rng.choice(8, 12, p=prefs[d, l]) for l in range(2)], 1)[:, :, None]
            records.append(RequestRecord(f"q{i}", domains[d], 6, 12, rank=None if ranks is None else int(ranks[i])))
            rows.append(ids)
        with TraceWriter(path, meta) as w:
            w.add_requests(records, np.concatenate(rows).astype(np.int16))
        return TraceReader(path)

    planning = write(tmp_path / "plan-trace", 80)
    topology = Topology(2, 2, 3)
    plan = make_plan("locality", planning, topology, (0, 80)).plan
    plan.save(tmp_path / "plan.json")
    served = write(tmp_path / "served", 40, ranks=rng.integers(0, 4, 40))
    recorded = np.array([r.rank for r in served.requests])
    out = replay(served, plan, topology, Assignment("recorded", 0, recorded))
    report = tmp_path / "bound.json"
    run_bench("locality_bound.py", "--trace", str(tmp_path / "served"), "--plan", str(tmp_path / "plan.json"),
              "--out", str(report))
    got = json.loads(report.read_text())
    assert got["plan"] == out.inter_node_bytes / served.num_tokens
    assert got["best_placement"] <= got["plan"] + 1e-9
    assert got["on_domain_nodes"] <= got["plan"] + 1e-9 or got["off_domain_requests"] > 0
