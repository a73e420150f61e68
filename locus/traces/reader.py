"""TraceReader: open, validate and iterate a locus-trace v1 directory without loading it into RAM.

The arrays are memory-mapped; chunks are views. Opening checks everything the format promises
(metadata, every request line, array dtypes and shapes against the requests, expert id range),
and the id range check itself streams over the rows in bounded blocks.

Whole-trace passes (validation, statistics) read blocks with plain file reads (copy=True) instead
of touching the mapping: mapped pages count towards the process's resident size until the kernel
reclaims them, so a scan over a 2 GB trace would otherwise look like a 2 GB process.

Shape legend: N tokens (rows), L MoE layers, K top-k, R requests, n tokens of one request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from locus.traces.format import (
    EPOCHS_FILE,
    IDS_FILE,
    KIND_COUNTS,
    META_FILE,
    PLANS_DIR,
    REQUESTS_FILE,
    WEIGHTS_FILE,
    TOKENS_FILE,
    RequestRecord,
    TraceFormatError,
    TraceMeta,
    parse_request,
    read_meta_json,
)
from locus.traces.npyfile import open_npy

# Ids per block of the id-range scan (int16): 32 MB, whatever the row shape.
SCAN_IDS = 1 << 24
# Rows per chunk of the streaming passes over a trace (replay, expert loads, request signatures): about
# this many (token, layer, k) routings, so that a chunk's int64 temporaries (~4 MiB) stay in cache
# while numpy's per-call overhead is amortised (bench/replay.py measured it).
CHUNK_ROUTINGS = 1 << 19


@dataclass
class TraceChunk:
    """Whole requests [request_start, request_stop) whose rows start at row_start."""

    request_start: int
    request_stop: int
    row_start: int
    expert_ids: np.ndarray  # [rows, L, K] view
    expert_weights: np.ndarray | None = None  # [rows, L, K] view, if the trace has weights

    @property
    def row_stop(self) -> int:
        return self.row_start + self.expert_ids.shape[0]

    @property
    def num_requests(self) -> int:
        return self.request_stop - self.request_start


class TraceReader:
    """A validated, memory-mapped trace. check_ids=False skips the id-range scan (one pass over the
    rows) for a caller that has just validated the same trace."""

    def __init__(self, path: str | Path, check_ids: bool = True):
        self.path = Path(path)
        raw = read_meta_json(self.path)
        if raw.get("kind", "tokens") == KIND_COUNTS:
            raise TraceFormatError(
                f"{self.path / META_FILE}: this is a count trace (kind 'counts'); open it with read_counts()"
            )
        self.meta: TraceMeta = TraceMeta.from_json(raw, self.path / META_FILE)
        self.requests: list[RequestRecord] = read_requests(self.path / REQUESTS_FILE)
        tokens = np.fromiter((r.tokens for r in self.requests), dtype=np.int64, count=len(self.requests))
        self.offsets: np.ndarray = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)  # [R+1]
        self.expert_ids: np.ndarray = open_npy(self.path / IDS_FILE, np.int16, 3)
        self._check_shape(self.path / IDS_FILE, self.expert_ids.shape)
        weights_path = self.path / WEIGHTS_FILE
        self.expert_weights: np.ndarray | None = None
        if weights_path.exists():
            self.expert_weights = open_npy(weights_path, np.float16, 3)
            if self.expert_weights.shape != self.expert_ids.shape:
                raise TraceFormatError(
                    f"{weights_path}: shape {self.expert_weights.shape} does not match {IDS_FILE} {self.expert_ids.shape}"
                )
        # [N] int32, when the trace was recorded across placement epochs
        self.epochs: np.ndarray | None = self._per_row(self.path / EPOCHS_FILE, "epochs")
        # [N] int32, the token each row fed the model, when recorded
        self.token_ids: np.ndarray | None = self._per_row(self.path / TOKENS_FILE, "token ids", self.meta.vocab_size)
        if check_ids:
            self.check_expert_ids()

    def _per_row(self, path: Path, what: str, bound: int | None = None) -> np.ndarray | None:
        """An optional int32 file of one non-negative value per row (below `bound` when given)."""
        if not path.exists():
            return None
        values = open_npy(path, np.int32, 1)
        if values.shape != (self.num_tokens,):
            raise TraceFormatError(f"{path}: {values.shape[0]} rows, {REQUESTS_FILE} accounts for {self.num_tokens} tokens")
        if self.num_tokens:
            low, high = int(np.min(values)), int(np.max(values))
            if low < 0:
                raise TraceFormatError(f"{path}: {what} must be non-negative, got {low}")
            if bound is not None and high >= bound:
                raise TraceFormatError(f"{path}: {what} reach {high}, outside 0..{bound - 1} (meta.json vocab_size {bound})")
        return values

    def plans(self) -> dict[int, dict]:
        """The placement plans kept with the trace (plans/epoch-<e>.json), by epoch, as JSON objects."""
        out = {}
        folder = self.path / PLANS_DIR
        if not folder.is_dir():
            return out
        for path in sorted(folder.glob("epoch-*.json")):
            try:
                epoch = int(path.stem.removeprefix("epoch-"))
                data = json.loads(path.read_text())
            except ValueError as exc:  # a bad name, not UTF-8, not JSON
                raise TraceFormatError(f"{path}: not a plan file of an epoch ({exc})") from None
            except RecursionError:
                raise TraceFormatError(f"{path}: not a plan file of an epoch (JSON nested too deeply to read)") from None
            except OSError as exc:
                raise TraceFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
            if not isinstance(data, dict):
                raise TraceFormatError(f"{path}: a plan must be a JSON object")
            out[epoch] = data
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def _check_shape(self, path: Path, shape: tuple[int, ...]) -> None:
        want = (self.num_tokens, self.meta.num_layers, self.meta.top_k)
        if tuple(shape[1:]) != want[1:]:
            raise TraceFormatError(
                f"{path}: rows are {tuple(shape[1:])} but meta.json says {want[1]} MoE layers x top_k {want[2]}"
            )
        if shape[0] != want[0]:
            raise TraceFormatError(
                f"{path}: has {shape[0]} rows but {REQUESTS_FILE} accounts for {want[0]} tokens "
                f"({len(self.requests)} requests)"
            )

    def read_rows(self, start: int, stop: int, weights: bool = False) -> np.ndarray:
        """Rows [start, stop) [rows, L, K] read into a fresh array (not a view of the mapping)."""
        arr = self.expert_weights if weights else self.expert_ids
        if arr is None:
            raise ValueError(f"{self.path}: this trace has no expert weights")
        stop = min(stop, arr.shape[0])
        if not isinstance(arr, np.memmap) or stop <= start:
            return np.array(arr[start:stop])
        row_bytes = arr.itemsize * arr.shape[1] * arr.shape[2]
        with open(arr.filename, "rb") as f:
            f.seek(arr.offset + start * row_bytes)
            out = np.fromfile(f, dtype=arr.dtype, count=(stop - start) * arr.shape[1] * arr.shape[2])
        return out.reshape(stop - start, *arr.shape[1:])

    def check_expert_ids(self, scan_rows: int | None = None) -> None:
        """Every id must be -1 or in 0..E-1; streams over the rows so traces larger than RAM pass."""
        E = self.meta.num_experts
        scan_rows = scan_rows or max(1, SCAN_IDS // (self.meta.num_layers * self.meta.top_k))
        for start in range(0, self.num_tokens, scan_rows):
            block = self.read_rows(start, start + scan_rows)
            if block.size == 0 or (block.min() >= -1 and block.max() < E):
                continue
            bad = (block < -1) | (block >= E)
            if bad.any():
                i, layer, slot = (int(x) for x in np.argwhere(bad)[0])
                row = start + i
                r = int(np.searchsorted(self.offsets, row, side="right")) - 1
                raise TraceFormatError(
                    f"{self.path / IDS_FILE}: row {row} (request {self.requests[r].id!r}), MoE layer "
                    f"{self.meta.moe_layers[layer]}, slot {slot}: expert id {int(block[i, layer, slot])} "
                    f"outside -1..{E - 1} (num_experts {E})"
                )

    def request_rows(self, r: int) -> np.ndarray:
        """Request r's rows [n, L, K] (a view; the first prompt_tokens rows are prefill)."""
        return self.expert_ids[self.offsets[r] : self.offsets[r + 1]]

    def iter_requests(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[RequestRecord, np.ndarray]]:
        stop = len(self.requests) if stop is None else stop
        for r in range(start, stop):
            yield self.requests[r], self.request_rows(r)

    def iter_chunks(
        self, max_tokens: int, start: int = 0, stop: int | None = None, max_requests: int | None = None,
        copy: bool = False,
    ) -> Iterator[TraceChunk]:
        """Consecutive whole requests of at most max_tokens rows (and max_requests requests) each.

        A request longer than max_tokens is a chunk of its own. copy=True reads each chunk into a
        fresh array instead of returning views (see the module docstring).
        """
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        stop = len(self.requests) if stop is None else stop
        offsets = self.offsets
        r = start
        while r < stop:
            # Last request end that keeps the chunk within budget; at least one request.
            end = int(np.searchsorted(offsets, offsets[r] + max_tokens, side="right")) - 1
            end = min(max(end, r + 1), stop)
            if max_requests is not None:
                end = min(end, r + max_requests)
            lo, hi = int(offsets[r]), int(offsets[end])
            if copy:
                ids = self.read_rows(lo, hi)
                weights = None if self.expert_weights is None else self.read_rows(lo, hi, weights=True)
            else:
                ids = self.expert_ids[lo:hi]
                weights = None if self.expert_weights is None else self.expert_weights[lo:hi]
            yield TraceChunk(r, end, lo, ids, weights)
            r = end


def read_requests(path: Path) -> list[RequestRecord]:
    """Parse and check requests.jsonl (every line; ids unique)."""
    requests: list[RequestRecord] = []
    seen: dict[str, int] = {}
    try:
        f = open(path)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: missing") from None
    with f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    raise TraceFormatError(f"{path}: line {lineno}: empty line")
                record = parse_request(line, path, lineno)
                if record.id in seen:
                    raise TraceFormatError(
                        f"{path}: line {lineno}: duplicate request id {record.id!r} (first on line {seen[record.id]})"
                    )
                seen[record.id] = lineno
                requests.append(record)
        except UnicodeDecodeError as exc:
            raise TraceFormatError(f"{path}: not UTF-8 text ({exc})") from None
    return requests
