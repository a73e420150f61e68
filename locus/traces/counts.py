"""Count traces: per-layer expert load without per-token rows (what count-only sources give).

A count trace is a directory:
    meta.json    TraceMeta.to_json() plus "kind": "counts" and "num_tokens" (int or null)
    counts.npy   int64 [L, E]: counts[l, e] = (token, slot) pairs routed to expert e at MoE layer
                 moe_layers[l]
Planners that only need load (e.g. EPLB-style balancing) accept either kind through read_counts(),
which sums a token trace's rows on the fly.

Shape legend: L MoE layers, E experts.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from locus.traces.format import (
    COUNTS_FILE,
    KIND_COUNTS,
    META_FILE,
    TraceFormatError,
    TraceMeta,
    read_meta_json,
    trace_kind,
)
from locus.traces.npyfile import open_npy
from locus.traces.writer import check_target, replace_dir, staging_dir


@dataclass(frozen=True)
class CountTrace:
    meta: TraceMeta
    counts: np.ndarray  # int64 [L, E]
    num_tokens: int | None  # tokens behind the counts, if the source said


def write_counts(
    path: str | Path, meta: TraceMeta, counts: np.ndarray, num_tokens: int | None = None, overwrite: bool = False
) -> None:
    path = Path(path)
    counts = np.asarray(counts)
    want = (meta.num_layers, meta.num_experts)
    if counts.shape != want:
        raise TraceFormatError(f"{path}: counts has shape {counts.shape}, expected {want} (MoE layers x experts)")
    if counts.size and counts.min() < 0:
        raise TraceFormatError(f"{path}: counts must be non-negative")
    check_target(path, overwrite)
    staging = staging_dir(path)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        np.save(staging / COUNTS_FILE, counts.astype(np.int64))
        doc = {**meta.to_json(), "kind": KIND_COUNTS, "num_tokens": num_tokens}
        (staging / META_FILE).write_text(json.dumps(doc, indent=1) + "\n")
        replace_dir(staging, path, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_counts(path: str | Path) -> CountTrace:
    """Expert load of a count trace, or of a token trace (summed in streaming chunks)."""
    path = Path(path)
    if trace_kind(path) != KIND_COUNTS:
        from locus.traces.reader import TraceReader

        return count_tokens(TraceReader(path))
    raw = read_meta_json(path)
    meta = TraceMeta.from_json(raw, path / META_FILE)
    num_tokens = raw.get("num_tokens")
    if num_tokens is not None and (not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0):
        raise TraceFormatError(
            f"{path / META_FILE}: \"num_tokens\" must be a non-negative integer or null, got {num_tokens!r}"
        )
    counts = np.asarray(open_npy(path / COUNTS_FILE, np.int64, 2))
    want = (meta.num_layers, meta.num_experts)
    if counts.shape != want:
        raise TraceFormatError(
            f"{path / COUNTS_FILE}: shape {counts.shape}, meta.json says {want} (MoE layers x experts)"
        )
    if counts.size and counts.min() < 0:
        raise TraceFormatError(f"{path / COUNTS_FILE}: negative count {counts.min()}")
    return CountTrace(meta, counts, num_tokens)


def count_expert_ids(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """The one tally of routings: expert ids [T, L, K] (-1 = none) -> (token, k) pairs per layer
    and expert, [L, E] int64. Used for traces, replay, the engine's /metrics and the grouper."""
    ids = np.asarray(expert_ids, dtype=np.int64)
    L = ids.shape[1]
    keys = (ids + (np.arange(L, dtype=np.int64) * num_experts)[None, :, None])[ids >= 0]
    return np.bincount(keys, minlength=L * num_experts).reshape(L, num_experts)


def count_tokens(reader, max_tokens: int = 1 << 18) -> CountTrace:
    """Per-layer expert load [L, E] of a token trace (TraceReader), streamed in chunks."""
    L, E = reader.meta.num_layers, reader.meta.num_experts
    counts = np.zeros((L, E), dtype=np.int64)
    for chunk in reader.iter_chunks(max_tokens, copy=True):
        counts += count_expert_ids(chunk.expert_ids, E)
    return CountTrace(reader.meta, counts, reader.num_tokens)
