"""PairCounts: per-request (layer, expert) pair counts held in one byte each, read as float32 rows.

The planner keeps a count per (request, MoE layer, expert) for every planning request's prefill and for
its decode. Held as float32 these are 2 x R x L x E x 4 bytes: at 10M planning tokens of the DeepSeek-V3
preset (~24,000 requests x 58 x 256) 2.8 GB. Nearly every entry is non-zero (a request's few hundred
tokens x top-k picks touch most experts of a layer), so a sparse layout saves nothing; but nearly every
entry is small: on the DeepSeek-V3 and Qwen3-235B presets about 1 in 1,000 reaches 255. So each count
is stored as a uint8, saturated at 255, and the entries at 255 or above are kept exactly beside it
(sorted flat positions and int64 values), which is 1/4 of the float32 bytes.

Reads return float32, exactly the counts (integers below 2^24), so every consumer that took the dense
float32 arrays gets the same numbers: `counts[a:b]`, `counts[rows]` and `np.asarray(counts)` (the
whole array: only for small data). `group_sums` adds rows up by group, block by block, without a
dense copy of the whole array.

Shape legend: R requests (rows), L MoE layers, E experts, M entries at or above SATURATED.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SATURATED = 255  # the uint8 value that means "read the exact count from the overflow entries"
# Rows per block of group_sums: a float64 block of ~30 MB at DeepSeek-V3's 58 x 256, one BLAS product each.
SUM_ROWS = 256


@dataclass(frozen=True)
class PairCounts:
    low: np.ndarray  # [R, L, E] uint8, min(count, SATURATED)
    over_pos: np.ndarray  # [M] int64, ascending flat positions (row * L * E + l * E + e) with count >= SATURATED
    over_val: np.ndarray  # [M] int64, the exact counts there
    over_ptr: np.ndarray  # [R + 1] int64, row r's overflow entries are over_pos[over_ptr[r]:over_ptr[r + 1]]

    @classmethod
    def from_parts(cls, low: np.ndarray, over_pos: np.ndarray, over_val: np.ndarray) -> "PairCounts":
        """From saturated counts and their overflow entries (positions ascending)."""
        if low.dtype != np.uint8 or low.ndim != 3:
            raise ValueError(f"low counts must be a uint8 [R, L, E] array, got {low.dtype} {low.shape}")
        over_pos = np.asarray(over_pos, dtype=np.int64)
        row_size = low.shape[1] * low.shape[2]
        ptr = np.searchsorted(over_pos, np.arange(low.shape[0] + 1, dtype=np.int64) * row_size)
        return cls(low, over_pos, np.asarray(over_val, dtype=np.int64), ptr.astype(np.int64))

    @classmethod
    def from_dense(cls, counts: np.ndarray) -> "PairCounts":
        """From whole non-negative integer counts [R, L, E] (any numeric dtype)."""
        counts = np.asarray(counts)
        if counts.ndim != 3:
            raise ValueError(f"pair counts must be [R, L, E], got shape {counts.shape}")
        exact = counts.astype(np.int64)
        if counts.size and (exact.min() < 0 or not np.array_equal(exact, counts)):
            raise ValueError("pair counts must be non-negative integers")
        flat = exact.reshape(-1)
        pos = np.flatnonzero(flat >= SATURATED)
        return cls.from_parts(np.minimum(exact, SATURATED).astype(np.uint8), pos, flat[pos])

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.low.shape

    @property
    def ndim(self) -> int:
        return 3

    @property
    def dtype(self) -> np.dtype:
        """What reads return."""
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.low.nbytes + self.over_pos.nbytes + self.over_val.nbytes + self.over_ptr.nbytes

    def __len__(self) -> int:
        return self.low.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        """Rows as float32 [n, L, E]: a slice (step 1), an integer array or a boolean mask over rows, or one
        row [L, E] for an integer."""
        R = len(self)
        if isinstance(index, (int, np.integer)):
            r = int(index) + R if index < 0 else int(index)
            if not 0 <= r < R:
                raise IndexError(f"row {index} out of range for {R} rows")
            return self.rows(np.array([r]))[0]
        if isinstance(index, slice):
            lo, hi, step = index.indices(R)
            if step != 1:
                return self.rows(np.arange(lo, hi, step))
            return self._range(lo, max(lo, hi))
        rows = np.asarray(index)
        if rows.dtype == bool:
            if rows.shape != (R,):
                raise IndexError(f"a boolean row mask must have shape ({R},), got {rows.shape}")
            rows = np.flatnonzero(rows)
        return self.rows(rows)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self._range(0, len(self))
        return out if dtype is None else out.astype(dtype, copy=False)

    def _range(self, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) as float32."""
        out = self.low[lo:hi].astype(np.float32)
        a, b = self.over_ptr[lo], self.over_ptr[hi]
        if b > a:
            row_size = out[0].size
            out.reshape(-1)[self.over_pos[a:b] - lo * row_size] = self.over_val[a:b]
        return out

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows [n] (integers in 0..R-1, any order, repeats allowed) as float32 [n, L, E]."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        R = len(self)
        if rows.size and (rows.min() < -R or rows.max() >= R):
            raise IndexError(f"row index out of range for {R} rows")
        rows = np.where(rows < 0, rows + R, rows)
        out = self.low[rows].astype(np.float32)
        starts, stops = self.over_ptr[rows], self.over_ptr[rows + 1]
        sizes = stops - starts
        if sizes.sum():
            row_size = self.low[0].size
            which = np.repeat(np.arange(len(rows)), sizes)  # output row of each overflow entry
            entry = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()))
            offset = self.over_pos[entry] - rows[which] * row_size
            out.reshape(len(rows), -1)[which, offset] = self.over_val[entry]
        return out

    def group_sums(self, group: np.ndarray, groups: int) -> np.ndarray:
        """Sum of each group's rows, [groups, L, E] float64; group [R] in 0..groups-1, -1 = no group. Exact
        (integers below 2^53), whatever the order of the blocks' products."""
        group = np.asarray(group, dtype=np.int64)
        R, L, E = self.shape
        if group.shape != (R,):
            raise ValueError(f"group must have one entry per row ({R}), got shape {group.shape}")
        if R and (group.min() < -1 or group.max() >= groups):
            raise ValueError(f"groups must lie in -1..{groups - 1}")
        out = np.zeros((groups, L * E), dtype=np.float64)
        for lo in range(0, R, SUM_ROWS):
            hi = min(lo + SUM_ROWS, R)
            onehot = np.zeros((groups, hi - lo), dtype=np.float64)
            mine = group[lo:hi] >= 0
            onehot[group[lo:hi][mine], np.flatnonzero(mine)] = 1.0
            out += onehot @ self._range(lo, hi).reshape(hi - lo, L * E).astype(np.float64)
        return out.reshape(groups, L, E)
