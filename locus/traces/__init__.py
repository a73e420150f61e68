"""Expert-activation traces: format, reader/writer, synthesis, import, statistics. numpy only.

The names below load on first use, so `import locus.traces` (and `locus --help`) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TraceFormatError": "format", "TraceMeta": "format", "RequestRecord": "format",
    "TraceWriter": "writer",
    "TraceReader": "reader", "TraceChunk": "reader",
    "CountTrace": "counts", "read_counts": "counts", "write_counts": "counts",
    "SynthConfig": "synth", "LengthDist": "synth", "synthesize": "synth", "generate": "synth",
    "PRESETS": "presets", "preset_config": "presets",
    "TraceStats": "stats", "compute_stats": "stats",
    "ImportOptions": "importers", "import_trace": "importers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'locus.traces' has no attribute {name!r}")
    return getattr(importlib.import_module(f"locus.traces.{_EXPORTS[name]}"), name)
