"""What every importer shares: options, the result, and filling in the metadata a source lacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from locus.traces.format import TraceFormatError, TraceMeta
from locus.traces.presets import find_preset


@dataclass(frozen=True)
class ImportOptions:
    """What the source may not say; None means "infer it, or take it from the preset named by model"."""

    model: str | None = None
    hidden_size: int | None = None
    num_experts: int | None = None
    top_k: int | None = None  # only count-only sources need it
    moe_layers: tuple[int, ...] | None = None
    domain: str = "unknown"  # for requests whose source record names none
    overwrite: bool = False


@dataclass
class ImportResult:
    path: Path
    kind: str  # "tokens" or "counts"
    meta: TraceMeta
    num_requests: int | None
    num_tokens: int | None
    notes: list[str] = field(default_factory=list)  # what was inferred, for the user to check


@dataclass
class Observed:
    """Shapes seen in the source during the first pass."""

    num_layers: int = -1
    top_k: int = -1
    max_id: int = -1
    layer_indices: tuple[int, ...] | None = None  # model layer indices, where the source names them
    num_experts: int | None = None  # where the source states it (e.g. SGLang's expert map)


def resolve_meta(src: Path, options: ImportOptions, seen: Observed, source: str, notes: list[str]) -> TraceMeta:
    """Metadata from options, then the source, then the preset named by --model; notes what was guessed."""
    preset = find_preset(options.model) if options.model else None
    model = options.model or "unknown"
    hidden = options.hidden_size or (preset.hidden_size if preset else None)
    if hidden is None:
        raise TraceFormatError(
            f"{src}: the source does not say the model's hidden size; pass --hidden-size (or --model with a preset name)"
        )
    num_experts = options.num_experts or seen.num_experts
    if num_experts is None and preset is not None:
        num_experts = preset.num_experts
    if num_experts is None:
        num_experts = seen.max_id + 1
        notes.append(
            f"num_experts inferred as {num_experts} (largest expert id + 1); pass --num-experts if experts were never chosen"
        )
    if seen.max_id >= num_experts:
        raise TraceFormatError(f"{src}: expert id {seen.max_id} >= num_experts {num_experts}")
    top_k = seen.top_k if seen.top_k > 0 else (options.top_k or (preset.top_k if preset else None))
    if top_k is None:
        raise TraceFormatError(f"{src}: the source does not say top-k; pass --top-k (or --model with a preset name)")
    layers = options.moe_layers or seen.layer_indices
    if layers is None and preset is not None and len(preset.moe_layers) == seen.num_layers:
        layers = preset.moe_layers
    if layers is None:
        layers = tuple(range(seen.num_layers))
        notes.append(
            f"MoE layer indices unknown; numbered 0..{seen.num_layers - 1} (pass --moe-layers for the model's own)"
        )
    if len(layers) != seen.num_layers:
        raise TraceFormatError(
            f"{src}: the source has {seen.num_layers} MoE layers but --moe-layers names {len(layers)}"
        )
    try:
        return TraceMeta(model, int(num_experts), int(top_k), tuple(layers), int(hidden), source=source)
    except TraceFormatError as exc:
        raise TraceFormatError(f"{src}: {str(exc).removeprefix('TraceMeta: ')}") from None


def parse_layers(spec: str) -> tuple[int, ...]:
    """'1,3,5' or 'start:stop[:step]' (Python range) -> layer indices."""
    spec = spec.strip()
    try:
        if ":" in spec:
            parts = [int(p) for p in spec.split(":")]
            return tuple(range(*parts))
        return tuple(int(p) for p in spec.split(",") if p.strip())
    except (ValueError, TypeError):
        raise TraceFormatError(f"--moe-layers: cannot parse {spec!r}; use '1,3,5' or 'start:stop[:step]'") from None
