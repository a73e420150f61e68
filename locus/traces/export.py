"""Trace -> other engines' files; the reverse of importers/.

`sglang-counts`: the trace's per-layer expert token counts in the layout of SGLang's
expert-distribution recorder `stat` dump (`_StatAccumulator.dump` in sglang/srt/eplb/
expert_distribution.py), which importers/sglang.py reads back and which SGLang's
`--init-expert-location` accepts too (a `logical_count` key makes it run its EPLB algorithm on the
counts at start-up, `ExpertLocationMetadata.init_by_eplb`, summing over the leading step dimension):

    {"rank": 0, "logical_count": int64 [1, NL, E], "average_utilization_rate_over_window": None}

Shape legend: NL model layers (SGLang counts every layer; dense ones stay zero), E experts, one step.
Rows are model layer indices, so the trace's MoE layer i lands in row moe_layers[i]. Counts are
(token, expert) pairs, as SGLang's recorder counts them. torch is imported only for a .pt output.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from locus.traces.counts import CountTrace, read_counts
from locus.traces.format import TraceFormatError

EXPORT_FORMATS = ("sglang-counts",)


@dataclass(frozen=True)
class ExportResult:
    path: Path
    num_hidden_layers: int
    num_experts: int
    pairs: int  # (token, expert) pairs written


def export_trace(trace: str | Path, fmt: str, out: str | Path, num_hidden_layers: int | None = None,
                 overwrite: bool = False) -> ExportResult:
    """Write `trace` (token or count trace) as `fmt` to `out` (.pt or .json)."""
    if fmt not in EXPORT_FORMATS:
        raise TraceFormatError(f"unknown export format {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    kind = _output_kind(out, overwrite)  # checked before the trace is read: it may be large
    counts = read_counts(trace)
    logical = sglang_logical_count(counts, num_hidden_layers)
    doc = {"rank": 0, "logical_count": logical, "average_utilization_rate_over_window": None}
    _save(out, kind, doc)
    return ExportResult(out, logical.shape[1], logical.shape[2], int(logical.sum()))


def sglang_logical_count(counts: CountTrace, num_hidden_layers: int | None = None) -> np.ndarray:
    """int64 [1, NL, E]: the trace's counts in their model-layer rows, zeros for the other layers."""
    layers = counts.meta.moe_layers
    total = num_hidden_layers if num_hidden_layers is not None else max(layers) + 1
    if total <= max(layers):
        raise TraceFormatError(f"--num-hidden-layers {total} is too small: the trace has MoE layer {max(layers)}")
    out = np.zeros((1, total, counts.meta.num_experts), dtype=np.int64)
    out[0, list(layers)] = counts.counts
    return out


def _output_kind(out: Path, overwrite: bool) -> str:
    kind = out.suffix.lower()
    if kind not in (".pt", ".json"):
        raise TraceFormatError(f"{out}: unknown file type {kind or '(none)'!r}; use a .pt or .json file name")
    if not out.parent.is_dir():
        raise TraceFormatError(f"cannot write {out}: directory {out.parent} does not exist")
    if out.exists() and not overwrite:
        raise TraceFormatError(f"{out} already exists; pass --force to replace it")
    return kind


def _save(out: Path, kind: str, doc: dict) -> None:
    """Via a temporary file renamed over `out`, so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if kind == ".json":
                f.write((json.dumps({**doc, "logical_count": doc["logical_count"].tolist()}) + "\n").encode())
            else:
                import torch

                torch.save({**doc, "logical_count": torch.from_numpy(doc["logical_count"])}, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise TraceFormatError(f"cannot write {out}: {exc.strerror or exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
