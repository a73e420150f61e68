"""The backends' layout in the plan's topology, and the rank pin of an endpoint serving several ranks."""

import pytest

from locus.errors import LocusError
from locus.router.backends import BackendPool, check_url, lay_out


def test_one_endpoint_per_rank_needs_no_pin():
    backends = lay_out([f"http://127.0.0.1:{8000 + i}/" for i in range(4)], 4, "locus")
    assert [(b.url, b.ranks, b.pin(b.ranks[0])) for b in backends] == [
        (f"http://127.0.0.1:{8000 + i}", (i,), None) for i in range(4)]


def test_one_endpoint_per_node_pins_the_rank_among_its_own():
    backends = lay_out(["http://a:1", "http://b:1"], 8, "sglang")
    assert [b.ranks for b in backends] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [backends[1].pin(r) for r in (4, 7)] == ["0", "3"]
    assert lay_out(["http://a:1"], 4, "vllm")[0].pin(2) == "2"  # one endpoint for all: the global rank


@pytest.mark.parametrize("urls, ranks, kind, message", [
    (["http://a:1"] * 2, 2, "locus", "given twice"),
    (["http://a:1", "http://b:1"], 4, "locus", "4 data-parallel ranks but 2 backend"),
    (["http://a:1", "http://b:1", "http://c:1"], 4, "vllm", r"one per rank, or a divisor of 4"),
    ([], 4, "locus", "no --backend given"),
    (["a:1"], 1, "locus", "expected a base URL"),
    (["http://a:1/v1"], 1, "locus", "expected a base URL"),
    (["http://a:99999"], 1, "locus", "port is not a number"),
    (["http://a:1"], 1, "tgi", "--backend-kind 'tgi'"),
])
def test_a_layout_that_does_not_fit_is_one_line(urls, ranks, kind, message):
    with pytest.raises(LocusError, match=message):
        lay_out(urls, ranks, kind)


def test_down_backends_make_their_ranks_unavailable():
    pool = BackendPool(lay_out(["http://a:1", "http://b:1"], 4, "sglang"))
    changed = []
    pool.on_change = changed.append
    assert pool.unavailable() == ()
    pool.set_state(pool.backends[1], False, "connection refused")
    assert pool.unavailable() == (2, 3) and pool.out()[0].reason == "connection refused" and len(changed) == 1
    pool.set_state(pool.backends[1], True)
    assert pool.unavailable() == () and pool.backends[1].reason is None and len(changed) == 2
    assert check_url("https://h:8443") == "https://h:8443"
