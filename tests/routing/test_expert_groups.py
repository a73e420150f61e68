"""locus/routing/expert_groups.py: a plan's expert groups across nodes, on hand-built placements, and the
group structure's checks."""

import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.expert_groups import KNOWN_GROUPS, ExpertGroups, group_figures, resolve_groups
from locus.routing.plan.topology import Topology

TWO_NODES = Topology(2, 1, 4)  # 2 nodes of one GPU, 4 slots each: 8 experts in 2 groups of 4
GROUPS = ExpertGroups(8, 2, topk_group=1)


def figures(layers, groups=GROUPS, topology=TWO_NODES, top_k=2):
    return group_figures(np.array(layers), groups, topology, top_k)


def test_an_aligned_placement_splits_no_group_and_bounds_a_token_by_topk_group():
    f = figures([[[0, 1, 2, 3], [4, 5, 6, 7]], [[7, 6, 5, 4], [3, 2, 1, 0]]])
    assert (f.split_groups, f.layer_groups, f.split_per_layer, f.max_span) == (0, 4, [0, 0], 1)
    assert (f.node_bound, f.aligned_bound) == (1, 1)


def test_a_group_split_across_two_nodes_is_counted():
    # layer 0: experts 3 and 4 swap nodes, so both groups lie on both nodes; layer 1 aligned
    f = figures([[[0, 1, 2, 4], [3, 5, 6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]])
    assert (f.split_groups, f.split_per_layer, f.max_span) == (2, [2, 0], 2)
    assert f.node_bound == 2  # a token of group 0 may need expert 3 (node 1) and expert 0 (node 0)


def test_a_replica_on_another_node_splits_its_group():
    f = figures([[[0, 1, 2, 3, 1], [4, 5, 6, 7, 5]]], topology=Topology(2, 1, 5))
    assert f.split_groups == 0
    f = figures([[[0, 1, 2, 3, 5], [4, 5, 6, 7, 1]]], topology=Topology(2, 1, 5))
    assert f.split_per_layer == [2]


def test_the_bound_is_never_above_top_k_or_the_nodes():
    # round robin over 4 nodes: every group on every node; top-2 of 1 group can reach 2 nodes, not 4
    topology = Topology(4, 1, 2)
    slots = [[[r, r + 4] for r in range(4)]]
    f = figures(slots, topology=topology, top_k=2)
    assert (f.max_span, f.node_bound, f.aligned_bound) == (4, 2, 1)
    f = figures(slots, groups=ExpertGroups(8, 2, topk_group=2), topology=topology, top_k=8)
    assert (f.node_bound, f.aligned_bound) == (4, 2)


def test_known_models_resolve_and_flags_override():
    assert resolve_groups("tiny-deepseek-v3", 16) == ExpertGroups(16, 4, 2)
    assert resolve_groups("deepseek-v3", 256) == ExpertGroups(256, 8, 4)
    assert resolve_groups("deepseek-v3", 256, topk_group=2).topk_group == 2
    assert resolve_groups("deepseek-v3", 256, expert_groups=8) == ExpertGroups(256, 8, 4)
    assert resolve_groups("deepseek-v3", 256, expert_groups=16) == ExpertGroups(256, 16, None)
    assert resolve_groups("toy", 32) is None
    assert resolve_groups("toy", 32, expert_groups=8) == ExpertGroups(32, 8, None)
    assert resolve_groups("tiny-deepseek-v3", 12) is None  # the name on another shape says nothing


def test_the_known_groups_are_the_presets_and_the_published_config():
    from locus.engine.checkpoint.presets import PRESETS

    c = PRESETS["tiny-deepseek-v3"]
    assert KNOWN_GROUPS["tiny-deepseek-v3"] == (c.num_local_experts, c.n_group, c.topk_group)
    assert KNOWN_GROUPS["deepseek-v3"] == (256, 8, 4)  # DeepSeek-V3's config.json: n_group 8, topk_group 4


@pytest.mark.parametrize("args, message", [
    (("toy", 32, 5), "--expert-groups 5 does not divide the model's 32 experts"),
    (("toy", 32, 0), "--expert-groups must be a positive integer"),
    (("toy", 32, 8, 9), "--topk-group must be in 1..8"),
    (("toy", 32, None, 2), "--topk-group needs --expert-groups"),
])
def test_bad_group_options_are_one_clear_error(args, message):
    with pytest.raises(LocusError, match=message):
        resolve_groups(*args)


def test_groups_that_do_not_fit_the_nodes_are_refused():
    ExpertGroups(16, 4, 2).check_fits(Topology(2, 1, 8))  # two groups a node
    with pytest.raises(LocusError, match="4 groups of 4 experts do not fit 2 nodes of 6 slots"):
        ExpertGroups(16, 4, 2).check_fits(Topology(2, 2, 3))  # 6 slots a node hold one group of 4


def test_a_trace_s_recorded_groups_are_read_and_checked(tmp_path):
    from locus.routing.expert_groups import trace_groups
    from locus.traces.format import TraceFormatError, TraceMeta
    from locus.traces.reader import TraceReader
    from locus.traces.writer import TraceWriter

    meta = TraceMeta("my-checkpoint", 16, 4, (1, 2), hidden_size=8, n_group=4, topk_group=2)
    with TraceWriter(tmp_path / "t", meta) as writer:
        writer.add_request("r0", "", 1, np.array([[[0, 1, 4, 5], [8, 9, 12, 13]]], dtype=np.int16))
    read = TraceReader(tmp_path / "t").meta
    assert (read.n_group, read.topk_group) == (4, 2)
    assert trace_groups(read) == ExpertGroups(16, 4, 2)
    assert trace_groups(read, expert_groups=8) == ExpertGroups(16, 8, None)  # the flag wins; 2 was for 4 groups
    assert trace_groups(TraceMeta("my-checkpoint", 16, 4, (1, 2), hidden_size=8)) is None
    for bad, message in (({"n_group": 4}, "go together"), ({"n_group": 5, "topk_group": 1}, "must divide"),
                         ({"n_group": 4, "topk_group": 5}, "must be in 1..n_group")):
        with pytest.raises(TraceFormatError, match=message):
            TraceMeta("m", 16, 4, (1,), hidden_size=8, **bad)


def test_an_engine_recording_of_a_group_limited_model_writes_its_groups(tmp_path):
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams
    from locus.traces.reader import TraceReader

    for preset, groups in (("tiny-deepseek-v3", (4, 2)), ("tiny-deepseek-v2-lite", (None, None))):
        llm = LLM(preset, seed=0)
        llm.engine.start_recording(tmp_path / preset, preset)
        llm.generate(["2 + 2 ="], SamplingParams(temperature=0.0, max_tokens=2))
        llm.engine.dump_recording()
        meta = TraceReader(tmp_path / preset).meta
        assert (meta.n_group, meta.topk_group) == groups


def test_rows_routed_outside_the_group_limit_are_counted():
    from locus.routing.expert_groups import rows_over_limit

    groups = ExpertGroups(8, 4, topk_group=2)  # groups {0,1} {2,3} {4,5} {6,7}
    ids = np.array([[[0, 1, 2, -1], [0, 2, 4, 6]], [[7, 6, -1, -1], [1, 3, 5, -1]]])  # [T=2, L=2, K=4]
    assert rows_over_limit(ids, groups) == 2  # rows using 4 and 3 groups; 2 groups and 1 group are within
    assert rows_over_limit(ids, ExpertGroups(8, 4, topk_group=4)) == 0
    assert rows_over_limit(ids, ExpertGroups(8, 4)) == 0  # no limit known
