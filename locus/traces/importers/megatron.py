"""Import Megatron-style routing records: JSONL, one line per (step, layer).

Each line: {"step": int, "layer": int, "top_indices": [[expert, ...] per token]} plus, optionally,
"rank" and "micro_batch" (which further split a step) and "domain". All lines of one
(step, rank, micro_batch) group must be consecutive and cover the same layers with the same token
count; each group becomes one request whose rows are all prefill (a training forward pass).
Layer indices are the model's own and become meta.json's moe_layers.

Two streaming passes: the first learns layers, k and the id range; the second assembles one group
at a time, so memory holds a single step, never the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from locus.traces.format import KIND_TOKENS, TraceFormatError, load_object
from locus.traces.importers.common import ImportOptions, ImportResult, Observed, resolve_meta
from locus.traces.writer import TraceWriter

GroupKey = tuple[Any, Any, Any]


def import_megatron(src: str | Path, dst: str | Path, options: ImportOptions) -> ImportResult:
    src = Path(src)
    seen = Observed()
    layers: set[int] = set()
    for key, domain, group, where in _groups(src):
        _check_group(group, where, seen)
        if layers and set(group) != layers:
            raise TraceFormatError(
                f"{where}: step group {_name(key)} covers layers {sorted(group)}, others {sorted(layers)}"
            )
        layers = layers or set(group)
    if not layers:
        raise TraceFormatError(f"{src}: no routing records")
    order = sorted(layers)
    seen.num_layers, seen.layer_indices = len(order), tuple(order)
    notes: list[str] = []
    meta = resolve_meta(src, options, seen, f"megatron:{src.name}", notes)
    with TraceWriter(dst, meta, overwrite=options.overwrite) as writer:
        for key, domain, group, _ in _groups(src):
            rows = np.stack([group[layer] for layer in order], axis=1)  # [n, L, K]
            writer.add_request(_name(key), domain or options.domain, rows.shape[0], rows)
    return ImportResult(Path(dst), KIND_TOKENS, meta, writer.num_requests, writer.num_tokens, notes)


def _name(key: GroupKey) -> str:
    step, rank, micro = key
    return f"step{step}" + (f"-rank{rank}" if rank is not None else "") + (f"-mb{micro}" if micro is not None else "")


def _check_group(group: dict[int, np.ndarray], where: str, seen: Observed) -> int:
    sizes = {a.shape for a in group.values()}
    if len(sizes) != 1:
        raise TraceFormatError(f"{where}: layers of one step disagree on [tokens, k]: {sorted(sizes)}")
    n, k = sizes.pop()
    if seen.top_k < 0:
        seen.top_k = k
    elif k != seen.top_k:
        raise TraceFormatError(f"{where}: top_indices has k={k}, earlier records k={seen.top_k}")
    for a in group.values():
        if a.size:
            if a.min() < -1:
                raise TraceFormatError(f"{where}: negative expert id {a.min()}")
            seen.max_id = max(seen.max_id, int(a.max()))
    return n


def _groups(src: Path) -> Iterator[tuple[GroupKey, str | None, dict[int, np.ndarray], str]]:
    """(key, domain, {layer: top_indices [n, k]}, where) per consecutive (step, rank, micro_batch) group."""
    done: set[GroupKey] = set()
    key: GroupKey | None = None
    group: dict[int, np.ndarray] = {}
    domain, group_where = None, str(src)
    for where, rec in _records(src):
        rkey = (rec["step"], rec.get("rank"), rec.get("micro_batch"))
        if rkey != key:
            if key is not None:
                done.add(key)
            if rkey in done:
                raise TraceFormatError(f"{where}: records of {_name(rkey)} are not consecutive (it appeared earlier)")
            if key is not None:
                yield key, domain, group, group_where
            key, group, domain = rkey, {}, rec.get("domain")
        layer = rec["layer"]
        if layer in group:
            raise TraceFormatError(f"{where}: layer {layer} of {_name(rkey)} appears twice")
        group[layer] = rec["top_indices"]
        group_where = where
    if key is not None:
        yield key, domain, group, group_where


def _records(src: Path) -> Iterator[tuple[str, dict]]:
    try:
        f = open(src)
    except OSError as exc:
        raise TraceFormatError(f"{src}: cannot open ({exc.strerror})") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{src}: line {lineno}"
            rec = load_object(line, where)
            for field in ("step", "layer", "top_indices"):
                if field not in rec:
                    raise TraceFormatError(f"{where}: missing field {field!r}")
            if not isinstance(rec["layer"], int) or rec["layer"] < 0:
                raise TraceFormatError(f"{where}: \"layer\" must be a non-negative integer, got {rec['layer']!r}")
            try:
                top = np.asarray(rec["top_indices"], dtype=np.int64)
            except (ValueError, TypeError):
                raise TraceFormatError(f"{where}: top_indices is not a [tokens, k] array of integers") from None
            if top.ndim != 2:
                raise TraceFormatError(f"{where}: top_indices has shape {top.shape}, expected [tokens, k]")
            rec["top_indices"] = top
            yield where, rec
