"""Import vLLM routed-experts output (server started with --enable-return-routed-experts).

Input: saved OpenAI-style responses, one JSON object per line (JSONL) or one JSON list of them.
Each response carries `prompt_routed_experts` [prompt tokens, layers, k] and each choice
`routed_experts` [generated tokens, layers, k] (nested lists). A response without
`prompt_routed_experts` whose choice holds prompt and generated rows together is split at
`usage.prompt_tokens` (or len(prompt_token_ids)). Every choice becomes one request (id
"<response id>-<choice index>" when there are several; the prompt rows are repeated for each).
The domain comes from a "domain" field (top level or under "metadata") or --domain.

Two passes over the file: the first learns the shapes, the second writes rows request by request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from locus.traces.format import KIND_TOKENS, TraceFormatError
from locus.traces.importers.common import ImportOptions, ImportResult, Observed, resolve_meta
from locus.traces.writer import TraceWriter


def import_vllm(src: str | Path, dst: str | Path, options: ImportOptions) -> ImportResult:
    src = Path(src)
    seen = Observed()
    ids: set[str] = set()
    for where, request in _iter_requests(src, options.domain):
        if request[0] in ids:
            raise TraceFormatError(f"{where}: duplicate request id {request[0]!r}")
        ids.add(request[0])
        _observe(seen, request, where)
    if seen.num_layers < 0:
        raise TraceFormatError(f"{src}: no responses with routed experts found")
    notes: list[str] = []
    meta = resolve_meta(src, options, seen, f"vllm:{src.name}", notes)
    with TraceWriter(dst, meta, overwrite=options.overwrite) as writer:
        for _, (rid, domain, prompt_rows, rows) in _iter_requests(src, options.domain):
            writer.add_request(rid, domain, prompt_rows, rows.reshape(-1, seen.num_layers, seen.top_k))
    return ImportResult(Path(dst), KIND_TOKENS, meta, writer.num_requests, writer.num_tokens, notes)


def _observe(seen: Observed, request: tuple[str, str, int, np.ndarray], where: str) -> None:
    rows = request[3]
    if rows.shape[0] == 0:
        return
    if seen.num_layers < 0:
        seen.num_layers, seen.top_k = rows.shape[1], rows.shape[2]
    elif rows.shape[1:] != (seen.num_layers, seen.top_k):
        raise TraceFormatError(
            f"{where}: routed experts are [*, {rows.shape[1]}, {rows.shape[2]}] but earlier responses had "
            f"[*, {seen.num_layers}, {seen.top_k}] (layers, k)"
        )
    if rows.min() < -1:
        raise TraceFormatError(f"{where}: negative expert id {rows.min()}")
    seen.max_id = max(seen.max_id, int(rows.max()))


def _iter_responses(src: Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed response) for a JSONL file or a JSON list."""
    try:
        f = open(src)
    except OSError as exc:
        raise TraceFormatError(f"{src}: cannot open ({exc.strerror})") from None
    with f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):
            try:
                items = json.load(f)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{src}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
            for i, item in enumerate(items):
                yield f"{src}: item {i}", item
            return
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"{src}: line {lineno}", json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{src}: line {lineno}: not valid JSON ({exc.msg})") from None


def _iter_requests(src: Path, default_domain: str) -> Iterator[tuple[str, tuple[str, str, int, np.ndarray]]]:
    """(where, (request id, domain, prompt tokens, rows [n, layers, k])) per choice of every response."""
    for index, (where, resp) in enumerate(_iter_responses(src)):
        if not isinstance(resp, dict):
            raise TraceFormatError(f"{where}: expected a response object, got {type(resp).__name__}")
        rid = str(resp.get("id") or resp.get("request_id") or f"response-{index}")
        meta = resp.get("metadata") if isinstance(resp.get("metadata"), dict) else {}
        domain = str(resp.get("domain") or meta.get("domain") or default_domain)
        prompt = resp.get("prompt_routed_experts")
        choices = resp.get("choices") or resp.get("outputs") or ([resp] if "routed_experts" in resp else [])
        if prompt is None and not any(isinstance(c, dict) and c.get("routed_experts") is not None for c in choices):
            raise TraceFormatError(
                f"{where}: no prompt_routed_experts or routed_experts (was vLLM started with --enable-return-routed-experts?)"
            )
        prompt_rows = _rows(prompt, f"{where}: prompt_routed_experts") if prompt is not None else None
        for i, choice in enumerate(choices or [{}]):
            if not isinstance(choice, dict):
                raise TraceFormatError(f"{where}: choice {i} is not an object")
            gen = choice.get("routed_experts")
            gen_rows = _rows(gen, f"{where}: choice {i} routed_experts") if gen is not None else None
            name = rid if len(choices) <= 1 else f"{rid}-{choice.get('index', i)}"
            yield where, _join(prompt_rows, gen_rows, resp, name, domain, where)


def _join(prompt_rows, gen_rows, resp: dict, name: str, domain: str, where: str) -> tuple[str, str, int, np.ndarray]:
    if prompt_rows is not None and gen_rows is not None:
        if prompt_rows.shape[0] and gen_rows.shape[0] and prompt_rows.shape[1:] != gen_rows.shape[1:]:
            raise TraceFormatError(
                f"{where}: prompt rows {prompt_rows.shape[1:]} and generated rows {gen_rows.shape[1:]} differ in (layers, k)"
            )
        parts = [r for r in (prompt_rows, gen_rows) if r.shape[0]]
        rows = np.concatenate(parts) if parts else prompt_rows
        return name, domain, prompt_rows.shape[0], rows
    if prompt_rows is not None:
        return name, domain, prompt_rows.shape[0], prompt_rows
    # Prompt and generated rows in one array: split where the prompt ends, if the response says.
    usage = resp.get("usage") if isinstance(resp.get("usage"), dict) else {}
    n_prompt = usage.get("prompt_tokens")
    if not isinstance(n_prompt, int) and isinstance(resp.get("prompt_token_ids"), list):
        n_prompt = len(resp["prompt_token_ids"])
    n_prompt = n_prompt if isinstance(n_prompt, int) and 0 <= n_prompt <= gen_rows.shape[0] else 0
    return name, domain, n_prompt, gen_rows


def _rows(value: Any, where: str) -> np.ndarray:
    """Nested lists -> int64 [n, layers, k]; an empty list is zero rows."""
    try:
        arr = np.asarray(value, dtype=np.int64)
    except (ValueError, TypeError):
        raise TraceFormatError(
            f"{where}: not a [tokens, layers, k] array of integers (ragged or non-numeric)"
        ) from None
    if arr.size == 0:
        return np.zeros((0, 0, 0), dtype=np.int64)
    if arr.ndim != 3:
        raise TraceFormatError(f"{where}: expected [tokens, layers, k], got an array of shape {arr.shape}")
    return arr
