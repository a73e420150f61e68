"""Importers: other engines' routing records -> locus traces (token traces, or count traces).

    import_trace("vllm" | "sglang" | "megatron", src, dst, ImportOptions(...)) -> ImportResult
"""

from __future__ import annotations

from pathlib import Path

from locus.traces.importers.common import ImportOptions, ImportResult, parse_layers
from locus.traces.importers.megatron import import_megatron
from locus.traces.importers.sglang import import_sglang
from locus.traces.importers.vllm import import_vllm

IMPORTERS = {"vllm": import_vllm, "sglang": import_sglang, "megatron": import_megatron}

__all__ = ["IMPORTERS", "ImportOptions", "ImportResult", "import_trace", "parse_layers"]


def import_trace(source: str, src: str | Path, dst: str | Path, options: ImportOptions | None = None) -> ImportResult:
    try:
        run = IMPORTERS[source]
    except KeyError:
        raise ValueError(f"unknown source {source!r}; choose one of {', '.join(IMPORTERS)}") from None
    return run(src, dst, options or ImportOptions())
