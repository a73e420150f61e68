import pytest

from locus.errors import LocusError
from locus.routing.plan.topology import Topology, parse_topology


def test_ranks_are_node_major():
    topo = Topology(2, 4, 3)
    assert topo.ranks == 8 and topo.total_slots == 24
    assert [topo.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.rank_nodes().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(LocusError, match="rank 8 is outside"):
        topo.node_of(8)


def test_parse_defaults_to_just_enough_slots():
    assert parse_topology("2x8", num_experts=128) == Topology(2, 8, 8)
    assert parse_topology("2x8", num_experts=129) == Topology(2, 8, 9)
    assert parse_topology(" 4X8 ", num_experts=256, slots=9) == Topology(4, 8, 9)


@pytest.mark.parametrize("text", ["2", "2x", "x8", "2x8x3", "two x eight", "", "0x8"])
def test_parse_rejects_malformed(text):
    with pytest.raises(LocusError, match="topology"):
        parse_topology(text, num_experts=8)


def test_too_few_slots_says_how_many_are_needed():
    with pytest.raises(LocusError, match=r"16 expert slots.*fewer than the 20 experts.*at least 3 slots"):
        parse_topology("2x4", num_experts=20, slots=2)


@pytest.mark.parametrize("args", [(0, 4, 2), (2, -1, 2), (2, 4, 0), (2.0, 4, 2), (True, 4, 2)])
def test_fields_must_be_positive_integers(args):
    with pytest.raises(LocusError, match="must be a positive integer"):
        Topology(*args)
