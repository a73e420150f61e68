"""PairCounts: one byte a count, the counts at 255 and above kept exactly; reads give the dense counts back."""

import numpy as np
import pytest

from locus.routing.grouping.pair_counts import SATURATED, PairCounts


@pytest.fixture
def dense():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 40, (9, 3, 5))
    counts[1, 0, 2] = SATURATED - 1  # the largest count held in the byte alone
    counts[1, 2, 4] = SATURATED  # the first overflow
    counts[4, 1, 0] = 3000
    counts[4, 1, 1] = 70000  # above uint16 too
    counts[8, 2, 4] = 256  # the very last entry
    return counts


def test_every_read_gives_the_dense_counts(dense):
    packed = PairCounts.from_dense(dense)
    assert packed.low.dtype == np.uint8 and len(packed.over_pos) == 4
    want = dense.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(packed), want)
    assert np.asarray(packed).dtype == np.float32
    for index in (slice(0, 9), slice(1, 5), slice(4, 5), slice(3, 3), slice(7, None), slice(None, None, 2)):
        np.testing.assert_array_equal(packed[index], want[index])
    rows = np.array([4, 0, 4, 8, 1, -1])  # any order, repeats, negative
    np.testing.assert_array_equal(packed[rows], want[rows])
    np.testing.assert_array_equal(packed.rows(rows), want[rows])
    mask = np.arange(9) % 3 == 1
    np.testing.assert_array_equal(packed[mask], want[mask])
    np.testing.assert_array_equal(packed[4], want[4])
    np.testing.assert_array_equal(packed[-1], want[-1])
    assert packed.shape == dense.shape and len(packed) == 9


def test_group_sums_are_the_dense_sums(dense):
    packed = PairCounts.from_dense(dense)
    group = np.array([0, 2, -1, 1, 2, 2, 0, -1, 1])
    want = np.stack([dense[group == g].sum(0) for g in range(3)]).astype(np.float64)
    np.testing.assert_array_equal(packed.group_sums(group, 3), want)
    with pytest.raises(ValueError, match="groups must lie in -1..2"):
        packed.group_sums(np.full(9, 3), 3)
    with pytest.raises(ValueError, match="one entry per row"):
        packed.group_sums(np.zeros(4), 3)


def test_group_sums_over_several_blocks(monkeypatch):
    import locus.routing.grouping.pair_counts as pair_counts

    monkeypatch.setattr(pair_counts, "SUM_ROWS", 4)  # 3 blocks, the last one short
    rng = np.random.default_rng(1)
    dense = rng.integers(0, 600, (11, 2, 3))
    group = rng.integers(-1, 2, 11)
    want = np.stack([dense[group == g].sum(0) for g in range(2)]).astype(np.float64)
    np.testing.assert_array_equal(PairCounts.from_dense(dense).group_sums(group, 2), want)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="non-negative integers"):
        PairCounts.from_dense(np.full((1, 1, 2), -1))
    with pytest.raises(ValueError, match="non-negative integers"):
        PairCounts.from_dense(np.full((1, 1, 2), 0.5))
    with pytest.raises(ValueError, match=r"\[R, L, E\]"):
        PairCounts.from_dense(np.zeros((2, 3)))
    with pytest.raises(IndexError):
        PairCounts.from_dense(np.zeros((2, 1, 1)))[2]
