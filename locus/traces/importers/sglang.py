"""Import SGLang expert-distribution recorder dumps (torch.save files; torch imported lazily).

SGLang (`--expert-distribution-recorder-mode`, then /dump_expert_distribution_record) writes:
- per_token mode: {"records": [one dict per forward pass, with "topk_ids_of_layer" int
  [num_layers, tokens, slots] (physical expert ids, -1 = unused slot), "forward_mode",
  "extend_seq_lens", ...], "last_physical_to_logical_map": [num_layers, physical experts]}, one
  file per rank -> a token trace. Dumps carry no request ids, so each sequence of an extend pass
  becomes a prefill-only request and each decode pass one decode-only pseudo-request; the
  prefill->decode statistics therefore have nothing to pair on such traces.
- per_pass records holding only "global_physical_count" [num_layers, physical experts], or stat
  mode: {"logical_count": [steps, num_layers, experts], ...} -> a count trace (counts.py).
Layer indices are the model's; layers no token was routed in (dense layers) are dropped unless
--moe-layers picks layers explicitly. Physical ids are mapped to logical experts with the dump's map.

Shape legend: NL model layers, n tokens of a pass, S recorded slots (SGLang pads to 8), P physical experts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from locus.traces.counts import write_counts
from locus.traces.format import KIND_COUNTS, KIND_TOKENS, MAX_EXPERTS, TraceFormatError
from locus.traces.importers.common import ImportOptions, ImportResult, Observed, resolve_meta
from locus.traces.writer import TraceWriter

EXTEND, DECODE, MIXED, IDLE = 1, 2, 3, 4  # SGLang ForwardMode values


def import_sglang(src: str | Path, dst: str | Path, options: ImportOptions) -> ImportResult:
    src = Path(src)
    files = sorted(src.glob("*.pt")) if src.is_dir() else [src]
    if not files:
        raise TraceFormatError(f"{src}: no .pt files in this directory")
    # The first file decides; every later one is checked against it as it is read.
    if _kind(files[0], _load(files[0])) == "tokens":
        return _import_tokens(src, files, dst, options)
    return _import_counts(src, files, dst, options)


def _load(path: Path) -> Any:
    try:
        import torch
    except ImportError:
        raise TraceFormatError(f"{path}: reading SGLang dumps needs torch (pip install torch)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: missing") from None
    except Exception as exc:  # torch raises many types for a bad file; all mean "not a dump"
        raise TraceFormatError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {exc})") from None


def _np(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _kind(path: Path, data: Any) -> str:
    if isinstance(data, dict) and "logical_count" in data:
        return "counts"
    if isinstance(data, dict) and isinstance(data.get("records"), list):
        recs = data["records"]
        if recs and all(isinstance(r, dict) and "topk_ids_of_layer" in r for r in recs):
            return "tokens"
        if recs and all(isinstance(r, dict) and "global_physical_count" in r for r in recs):
            return "counts"
        raise TraceFormatError(f"{path}: records hold neither topk_ids_of_layer nor global_physical_count")
    raise TraceFormatError(f"{path}: not an SGLang expert-distribution dump (no 'records' or 'logical_count')")


def _logical(topk: np.ndarray, p2l: np.ndarray | None) -> np.ndarray:
    """Physical -> logical ids, [NL, n, S]; -1 stays -1."""
    if p2l is None:
        return topk
    layer = np.arange(topk.shape[0])[:, None, None]
    return np.where(topk >= 0, p2l[layer, np.maximum(topk, 0)], -1)


def _expert_map(path: Path, value: Any, options: ImportOptions) -> np.ndarray:
    """A dump's physical -> logical map [NL, P], its ids checked before anything is sized by them."""
    p2l = _np(value).astype(np.int64)
    if p2l.ndim != 2:
        raise TraceFormatError(f"{path}: last_physical_to_logical_map has shape {p2l.shape}, expected [layers, physical]")
    limit = options.num_experts or MAX_EXPERTS
    if p2l.size and (p2l.min() < 0 or p2l.max() >= limit):
        bad = int(p2l.min()) if p2l.min() < 0 else int(p2l.max())
        source = "--num-experts" if options.num_experts else "a trace (int16 ids)"
        raise TraceFormatError(f"{path}: last_physical_to_logical_map holds logical id {bad}, outside 0..{limit - 1} "
                               f"(what {source} allows)")
    return p2l


def _passes(files: list[Path], options: ImportOptions) -> Iterator[tuple[str, dict, np.ndarray, np.ndarray | None]]:
    """(name, record, logical ids [NL, n, S], expert map) for every recorded forward pass."""
    for path in files:
        data = _load(path)
        if _kind(path, data) != "tokens":
            raise TraceFormatError(f"{path}: a count dump among per-token dumps; import them separately")
        p2l = data.get("last_physical_to_logical_map")
        p2l = None if p2l is None else _expert_map(path, p2l, options)
        for j, rec in enumerate(data["records"]):
            topk = _np(rec["topk_ids_of_layer"]).astype(np.int64)
            if topk.ndim != 3:
                raise TraceFormatError(
                    f"{path}: record {j}: topk_ids_of_layer has shape {topk.shape}, expected [layers, tokens, slots]"
                )
            if p2l is not None and (p2l.shape[0] != topk.shape[0] or topk.max(initial=-1) >= p2l.shape[1]):
                raise TraceFormatError(
                    f"{path}: record {j}: physical ids do not fit last_physical_to_logical_map {p2l.shape}"
                )
            yield f"{path.stem}#{j}", rec, _logical(topk, p2l), p2l


def _segments(name: str, rec: dict, n: int) -> list[tuple[str, int, int]]:
    """(request id, rows, prompt rows) pieces of one pass: sequences of an extend, or one decode block."""
    if rec.get("forward_mode") == DECODE:
        return [(name, n, 0)]
    lens = rec.get("extend_seq_lens")
    if isinstance(lens, (list, tuple)) and len(lens) and sum(int(x) for x in lens) == n:
        return [(f"{name}/seq{i}", int(k), int(k)) for i, k in enumerate(lens) if int(k) > 0]
    return [(name, n, n)]


def _import_tokens(src: Path, files: list[Path], dst, options: ImportOptions) -> ImportResult:
    seen, used, slots = Observed(), None, 0
    for _, _, ids, p2l in _passes(files, options):
        if ids.shape[1] == 0:
            continue
        layer_used = (ids >= 0).any(axis=(1, 2))
        used = layer_used if used is None else used | layer_used
        slots = max(slots, int(np.nonzero((ids >= 0).any(axis=(0, 1)))[0].max(initial=-1)) + 1)
        seen.max_id = max(seen.max_id, int(ids.max()))
        if p2l is not None:
            seen.num_experts = max(seen.num_experts or 0, int(p2l.max()) + 1)
    if used is None or slots == 0:
        raise TraceFormatError(f"{src}: the dump holds no routed tokens")
    layers = options.moe_layers or tuple(int(x) for x in np.nonzero(used)[0])
    seen.num_layers, seen.top_k, seen.layer_indices = len(layers), slots, tuple(layers)
    notes: list[str] = []
    meta = resolve_meta(src, dataclasses.replace(options, moe_layers=None), seen, f"sglang:{src.name}", notes)
    pick = list(layers)
    with TraceWriter(dst, meta, overwrite=options.overwrite) as writer:
        for name, rec, ids, _ in _passes(files, options):
            n = ids.shape[1]
            if n == 0 or rec.get("forward_mode") == IDLE:
                continue
            rows = ids[pick, :, :slots].transpose(1, 0, 2)  # [n, L, K]
            start = 0
            for rid, k, prompt in _segments(name, rec, n):
                writer.add_request(rid, options.domain, prompt, rows[start : start + k])
                start += k
    return ImportResult(Path(dst), KIND_TOKENS, meta, writer.num_requests, writer.num_tokens, notes)


def _import_counts(src: Path, files: list[Path], dst, options: ImportOptions) -> ImportResult:
    total = None
    seen = Observed()
    for path in files:
        data = _load(path)
        if _kind(path, data) != "counts":
            raise TraceFormatError(f"{path}: a per-token dump among count dumps; import them separately")
        if "logical_count" in data:
            c = _np(data["logical_count"]).astype(np.int64)
            c = c.reshape(-1, *c.shape[-2:]).sum(axis=0)  # [steps, NL, E] or [NL, E] -> [NL, E]
        else:  # per_pass records: physical counts per pass, mapped to logical experts here
            p2l = data.get("last_physical_to_logical_map")
            phys = sum(_np(r["global_physical_count"]).astype(np.int64) for r in data["records"])
            if p2l is None:
                c = phys
            else:
                p2l = _expert_map(path, p2l, options)
                c = np.zeros((phys.shape[0], int(p2l.max()) + 1), dtype=np.int64)
                np.add.at(c, (np.arange(phys.shape[0])[:, None], p2l), phys)
        if c.ndim != 2:
            raise TraceFormatError(f"{path}: counts have shape {c.shape}, expected [layers, experts]")
        if total is not None and total.shape != c.shape:
            raise TraceFormatError(f"{path}: counts shape {c.shape} differs from the other files' {total.shape}")
        total = c if total is None else total + c
    layers = options.moe_layers or tuple(int(x) for x in np.nonzero(total.sum(axis=1) > 0)[0])
    if not layers:
        raise TraceFormatError(f"{src}: every count is zero")
    if max(layers) >= total.shape[0]:
        raise TraceFormatError(
            f"{src}: --moe-layers names layer {max(layers)} but the dump has {total.shape[0]} layers"
        )
    counts = total[list(layers)]
    seen.num_layers, seen.layer_indices, seen.num_experts = len(layers), tuple(layers), counts.shape[1]
    seen.max_id = counts.shape[1] - 1
    notes: list[str] = []
    meta = resolve_meta(src, dataclasses.replace(options, moe_layers=None), seen, f"sglang:{src.name}", notes)
    per_layer = counts.sum(axis=1)
    # Every token routes top_k pairs per layer, so equal per-layer totals divisible by k give the token count.
    consistent = np.all(per_layer == per_layer[0]) and per_layer[0] % meta.top_k == 0
    tokens = int(per_layer[0] // meta.top_k) if consistent else None
    write_counts(dst, meta, counts, tokens, overwrite=options.overwrite)
    return ImportResult(Path(dst), KIND_COUNTS, meta, None, tokens, notes)
