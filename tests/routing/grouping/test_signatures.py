"""Request signatures held as PairCounts give the dense counts, sums and plans: checked against counts
made here from the trace's rows, and against the planner run on dense float32 signatures."""

import numpy as np
import pytest

import locus.routing.planners.planner as planner
from locus.routing.grouping.signatures import RequestSignatures, collect_signatures, group_demand
from locus.routing.plan.caps import Caps
from locus.routing.plan.topology import Topology
from locus.routing.planners.domain_layout import domain_profiles
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.traces.reader import TraceReader
from locus.traces.synth import LengthDist, SynthConfig, synthesize


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    """Long prompts over 16 experts, top-2: many counts reach 255, where the byte saturates."""
    path = tmp_path_factory.mktemp("signatures") / "t"
    config = SynthConfig(model="toy", num_experts=16, top_k=2, moe_layers=(0, 2, 4), hidden_size=64, requests=90,
                         seed=5, prompt_len=LengthDist(300, 0.9, 4, 3000), decode_len=LengthDist(60, 0.8, 1, 900),
                         zipf_exponent=0.9, domain_skew=1.0, request_spread=0.6)
    synthesize(config, path)
    return TraceReader(path)


def dense_counts(reader, start, stop):
    """[R, 2, L, E] int64 from each request's rows, one row at a time."""
    L, E = len(reader.meta.moe_layers), reader.meta.num_experts
    out = np.zeros((stop - start, 2, L, E), dtype=np.int64)
    for i, (record, rows) in enumerate(reader.iter_requests(start, stop)):
        for t, row in enumerate(np.asarray(rows)):
            for l in range(L):
                for e in row[l]:
                    if e >= 0:
                        out[i, int(t >= record.prompt_tokens), l, e] += 1
    return out


class DenseCounts:
    """The float32 [R, L, E] arrays the planner held before, with PairCounts' reads (group_sums as the
    planner's one-hot product over all requests)."""

    def __init__(self, counts):
        self.array = np.asarray(counts, dtype=np.float32)
        self.shape = self.array.shape

    def __len__(self):
        return len(self.array)

    def __getitem__(self, index):
        return self.array[index]

    def rows(self, rows):
        return self.array[rows]

    def group_sums(self, group, groups):
        R = len(self.array)
        onehot = np.zeros((groups, R), dtype=np.float32)
        mine = group >= 0
        onehot[group[mine], np.flatnonzero(mine)] = 1.0
        return (onehot @ self.array.reshape(R, -1)).astype(np.float64).reshape(groups, *self.shape[1:])


def dense_signatures(reader, start, stop):
    sig = collect_signatures(reader, start, stop)
    counts = dense_counts(reader, start, stop)
    return RequestSignatures(sig.start, sig.ids, sig.domains, sig.prompt_tokens, sig.tokens,
                             DenseCounts(counts[:, 0]), DenseCounts(counts[:, 1]), sig.top_k)


def test_signatures_count_every_pair(reader):
    sig = collect_signatures(reader, 10, 80)
    want = dense_counts(reader, 10, 80)
    assert (want >= 255).sum() > 20  # the overflow path is exercised
    np.testing.assert_array_equal(np.asarray(sig.prefill), want[:, 0])
    np.testing.assert_array_equal(np.asarray(sig.decode), want[:, 1])
    assert sig.prefill.low.nbytes == want[:, 0].size  # one byte a count


def test_sums_equal_the_dense_sums(reader):
    sig = collect_signatures(reader, 0, 90)
    counts = dense_counts(reader, 0, 90)
    total = (counts[:, 0] + counts[:, 1]).astype(np.float32)
    np.testing.assert_array_equal(sig.all_pairs(), total.sum(0))
    assert sig.all_pairs().dtype == np.float32
    np.testing.assert_array_equal(sig.domain_pairs(), domain_profiles(sig.domains, total))
    rows = np.array([5, 0, 89, 5])
    np.testing.assert_array_equal(sig.total_rows(rows), total[rows])
    rng = np.random.default_rng(0)
    prefill_node, decode_node = rng.integers(0, 3, 90), rng.integers(0, 3, 90)
    dense = dense_signatures(reader, 0, 90)
    np.testing.assert_array_equal(group_demand(sig, prefill_node, decode_node, 3),
                                  group_demand(dense, prefill_node, decode_node, 3))


@pytest.mark.parametrize("topology, budget", [(Topology(2, 2, 5), "top"), (Topology(4, 2, 3), "marginal")])
def test_plan_equals_the_dense_signatures_plan(reader, monkeypatch, topology, budget):
    options = PlanOptions(caps=Caps(expert=1.25), replica_budget=budget)
    compact = make_plan("locality", reader, topology, (0, 90), options)
    monkeypatch.setattr(planner, "collect_signatures", dense_signatures)
    dense = make_plan("locality", reader, topology, (0, 90), options)
    np.testing.assert_array_equal(compact.plan.slots, dense.plan.slots)
    assert compact.plan.grouping == dense.plan.grouping
    np.testing.assert_array_equal(compact.assignment.ranks, dense.assignment.ranks)
    a, b = compact.summary.to_dict(), dense.summary.to_dict()
    a.pop("plan_seconds"), b.pop("plan_seconds")
    assert a == b  # bytes per token (EPLB's too), locality, imbalances: to the last digit


@pytest.mark.parametrize("projected", [256, 16])  # 48 features as they are; projected to 16
def test_untagged_features_read_block_by_block_equal_the_whole_array_features(reader, monkeypatch, projected):
    import locus.routing.planners.request_clustering as clustering
    from locus.routing.plan.grouping_spec import normalise_rows

    sig = collect_signatures(reader, 0, 90)
    rows = np.arange(3, 90, 2)
    total = np.asarray(sig.total_rows(rows))
    np.testing.assert_array_equal(total, dense_counts(reader, 0, 90)[rows].sum(1))
    # the features as computed from the whole float64 array at once (the code before the blocks)
    flat = normalise_rows(total).reshape(len(rows), -1).astype(np.float32)
    if flat.shape[1] > projected:
        rng = np.random.default_rng(np.random.SeedSequence(0, spawn_key=(7,)))
        flat = flat @ rng.standard_normal((flat.shape[1], projected)).astype(np.float32)
    flat -= flat.mean(0)
    want = flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-12)
    monkeypatch.setattr(clustering, "FEATURE_ROWS", 8)  # 6 blocks, the last one short
    monkeypatch.setattr(clustering, "PROJECTED", projected)
    np.testing.assert_array_equal(clustering.signature_features(sig.total_rows(rows), seed=0), want)


def test_untagged_plan_equals_the_dense_signatures_plan(tmp_path, monkeypatch):
    from tests.routing.planners.planner_fixtures import separable_trace

    untagged = TraceReader(separable_trace(tmp_path / "sep", tagged=False))
    topology = Topology(4, 2, 2)
    compact = make_plan("locality", untagged, topology, (0, 120))
    monkeypatch.setattr(planner, "collect_signatures", dense_signatures)
    dense = make_plan("locality", untagged, topology, (0, 120))
    np.testing.assert_array_equal(compact.plan.slots, dense.plan.slots)
    np.testing.assert_array_equal(compact.assignment.ranks, dense.assignment.ranks)
    assert compact.summary.inter_node_bytes_per_token == dense.summary.inter_node_bytes_per_token
