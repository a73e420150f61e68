"""The locus-trace v1 contract: file names, metadata and request records, and their validation.

A token trace is a directory (see docs/design.md, "Trace format"):
    meta.json           TraceMeta.to_json()
    requests.jsonl      one RequestRecord per line, in row order
    expert_ids.npy      int16 [N, L, K]; -1 = no expert
    expert_weights.npy  float16 [N, L, K] (optional)
    epochs.npy          int32 [N] (optional): the placement epoch each row's routing ran under
    token_ids.npy       int32 [N] (optional): the token id each row fed the model (prompt, then the
                        generated tokens fed back), what a prompt-based predictor learns from
    plans/epoch-<e>.json (optional): the placement plan of epoch e, as written (JSON object)
A count trace (docs/traces.md "Count traces") shares meta.json, adds "kind": "counts", and holds
counts.npy int64 [L, E] instead of per-token rows.

Shape legend: N tokens (rows), L MoE layers, K experts per token, E experts, R requests.
Every check raises TraceFormatError whose message starts with the file at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_NAME = "locus-trace"
FORMAT_VERSION = 1
KIND_TOKENS = "tokens"
KIND_COUNTS = "counts"

META_FILE = "meta.json"
REQUESTS_FILE = "requests.jsonl"
IDS_FILE = "expert_ids.npy"
WEIGHTS_FILE = "expert_weights.npy"
COUNTS_FILE = "counts.npy"
EPOCHS_FILE = "epochs.npy"
TOKENS_FILE = "token_ids.npy"
PLANS_DIR = "plans"


def plan_file(epoch: int) -> str:
    """Where a trace keeps the placement plan of `epoch`, relative to the trace directory."""
    return f"{PLANS_DIR}/epoch-{int(epoch)}.json"

# Expert ids are stored as int16, so ids (and hence the expert count) must fit in it.
MAX_EXPERTS = 32767
# No model's hidden size is near this (the largest public ones are ~16-32k): a bigger one is a typo
# that would turn every byte figure into nonsense (10^30 GiB).
MAX_HIDDEN = 1 << 20
CONVENTIONAL_DOMAINS = ("code", "math", "chat", "general")


class TraceFormatError(ValueError):
    """A trace (or an import source) is missing, corrupt or inconsistent; the message names the file."""


@dataclass(frozen=True)
class TraceMeta:
    model: str
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    hidden_size: int
    dtype_bytes: int = 2
    source: str = ""
    vocab_size: int | None = None  # the model's vocabulary, when known (traces with token ids record it)
    # KV cache bytes one token occupies as served (all layers, K and V), when an engine recorded it: what
    # the replay counts per position a request moved after its prefill sent
    kv_bytes_per_token: int | None = None
    # group-limited routing (DeepSeek's n_group / topk_group), when the recording model has it: each token's
    # experts lie within topk_group of n_group groups of consecutive experts (what routing/expert_groups.py reads)
    n_group: int | None = None
    topk_group: int | None = None

    def __post_init__(self) -> None:
        # Accept any sequence for moe_layers but store a tuple, so the dataclass stays hashable.
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in self.moe_layers))
        check_meta(self, "TraceMeta")

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "model": self.model,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "moe_layers": list(self.moe_layers),
            "hidden_size": self.hidden_size,
            "dtype_bytes": self.dtype_bytes,
            "source": self.source,
            **({"vocab_size": self.vocab_size} if self.vocab_size is not None else {}),
            **({"kv_bytes_per_token": self.kv_bytes_per_token} if self.kv_bytes_per_token is not None else {}),
            **({"n_group": self.n_group, "topk_group": self.topk_group} if self.n_group is not None else {}),
        }

    @classmethod
    def from_json(cls, d: Any, path: str | Path = META_FILE) -> TraceMeta:
        if not isinstance(d, dict):
            raise TraceFormatError(f"{path}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{path}: \"format\" is {d.get('format')!r}, expected {FORMAT_NAME!r}")
        if d.get("version") != FORMAT_VERSION:
            raise TraceFormatError(
                f"{path}: unsupported version {d.get('version')!r} (this reader knows {FORMAT_VERSION})"
            )
        for key in ("model", "num_experts", "top_k", "moe_layers", "hidden_size"):
            if key not in d:
                raise TraceFormatError(f"{path}: missing field {key!r}")
        _expect(d, "model", str, path)
        _expect(d, "num_experts", int, path)
        _expect(d, "top_k", int, path)
        _expect(d, "hidden_size", int, path)
        _expect(d, "dtype_bytes", int, path, optional=True)
        _expect(d, "source", str, path, optional=True)
        _expect(d, "vocab_size", int, path, optional=True)
        _expect(d, "kv_bytes_per_token", int, path, optional=True)
        _expect(d, "n_group", int, path, optional=True)
        _expect(d, "topk_group", int, path, optional=True)
        layers = d["moe_layers"]
        if not isinstance(layers, list) or not all(_is_int(x) for x in layers):
            raise TraceFormatError(f"{path}: \"moe_layers\" must be a list of integers, got {layers!r}")
        try:
            return cls(
                model=d["model"],
                num_experts=d["num_experts"],
                top_k=d["top_k"],
                moe_layers=tuple(layers),
                hidden_size=d["hidden_size"],
                dtype_bytes=d.get("dtype_bytes", 2),
                source=d.get("source", ""),
                vocab_size=d.get("vocab_size"),
                kv_bytes_per_token=d.get("kv_bytes_per_token"),
                n_group=d.get("n_group"),
                topk_group=d.get("topk_group"),
            )
        except TraceFormatError as exc:  # re-label: the dataclass check does not know the file
            raise TraceFormatError(f"{path}: {str(exc).removeprefix('TraceMeta: ')}") from None


@dataclass(frozen=True)
class RequestRecord:
    id: str
    domain: str
    prompt_tokens: int
    tokens: int
    rank: int | None = None  # the rank it ran on, when recorded by an expert-parallel server
    # When recorded by an expert-parallel server: where its admission and its release fall in rank 0's
    # sequence of admissions and releases (one counter for both, from 0), and the tokens its admission
    # charged to its rank. What `locus replay --assign grouper` replays the live admission from.
    admitted: int | None = None
    released: int | None = None
    charge: int | None = None
    # When the server moved it after its prefill (docs/planner.md, "Moving a request after prefill"):
    # where, in the same sequence, rank 0 offered its prefill to the grouper (`observed`; set for every
    # request offered, moved or not), the rank its decode ran on after the move (`rank` is then where
    # its prefill ran), and the positions whose KV cache the move sent (its rows before that position
    # ran on `rank`, the others on `decode_rank`).
    observed: int | None = None
    decode_rank: int | None = None
    moved_tokens: int | None = None
    # Its client went away (or it was cancelled) before it finished: its rows are those that ran (a
    # prefill cut short has fewer than its prompt, and `prompt_tokens` is then `tokens`). Kept, as the
    # server counted their routing; written only when true, absent read as false.
    aborted: bool = False

    @property
    def decode_tokens(self) -> int:
        return self.tokens - self.prompt_tokens

    def to_json(self) -> dict[str, Any]:
        out = {"id": self.id, "domain": self.domain, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens}
        for key in ("rank", *ADMISSION_FIELDS):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.aborted:
            out["aborted"] = True
        return out


ADMISSION_FIELDS = ("admitted", "released", "charge", "observed", "decode_rank", "moved_tokens")


@dataclass(frozen=True)
class Admission:
    """A request's admission by an expert-parallel server's rank 0 (the RequestRecord fields above)."""

    admitted: int
    released: int | None
    charge: int
    observed: int | None = None
    prefill_rank: int | None = None  # with decode_rank: moved after its prefill, from this rank
    decode_rank: int | None = None
    moved_tokens: int | None = None


def check_meta(meta: TraceMeta, where: str) -> None:
    """Raise TraceFormatError('<where>: ...') if the metadata is internally inconsistent."""
    if not isinstance(meta.model, str):
        raise TraceFormatError(f"{where}: \"model\" must be a string")
    if not _is_int(meta.num_experts) or not 1 <= meta.num_experts <= MAX_EXPERTS:
        raise TraceFormatError(
            f"{where}: \"num_experts\" must be an integer in 1..{MAX_EXPERTS}, got {meta.num_experts!r}"
        )
    if not _is_int(meta.top_k) or not 1 <= meta.top_k <= meta.num_experts:
        raise TraceFormatError(
            f"{where}: \"top_k\" must be an integer in 1..num_experts ({meta.num_experts}), got {meta.top_k!r}"
        )
    if not meta.moe_layers:
        raise TraceFormatError(f"{where}: \"moe_layers\" is empty")
    if any(x < 0 for x in meta.moe_layers) or any(b <= a for a, b in zip(meta.moe_layers, meta.moe_layers[1:])):
        raise TraceFormatError(
            f"{where}: \"moe_layers\" must be strictly increasing non-negative layer indices, got {list(meta.moe_layers)}"
        )
    if not _is_int(meta.hidden_size) or not 1 <= meta.hidden_size <= MAX_HIDDEN:
        raise TraceFormatError(f"{where}: \"hidden_size\" must be an integer in 1..{MAX_HIDDEN}, got {meta.hidden_size!r}")
    if not _is_int(meta.dtype_bytes) or meta.dtype_bytes not in (1, 2, 4, 8):
        raise TraceFormatError(f"{where}: \"dtype_bytes\" must be 1, 2, 4 or 8, got {meta.dtype_bytes!r}")
    if not isinstance(meta.source, str):
        raise TraceFormatError(f"{where}: \"source\" must be a string")
    if meta.vocab_size is not None and (not _is_int(meta.vocab_size) or meta.vocab_size < 1):
        raise TraceFormatError(f"{where}: \"vocab_size\" must be a positive integer, got {meta.vocab_size!r}")
    if meta.kv_bytes_per_token is not None and (not _is_int(meta.kv_bytes_per_token) or meta.kv_bytes_per_token < 1):
        raise TraceFormatError(f"{where}: \"kv_bytes_per_token\" must be a positive integer, got {meta.kv_bytes_per_token!r}")
    if (meta.n_group is None) != (meta.topk_group is None):
        raise TraceFormatError(f"{where}: \"n_group\" and \"topk_group\" go together (give both or neither)")
    if meta.n_group is not None and (not _is_int(meta.n_group) or meta.n_group < 1 or meta.num_experts % meta.n_group):
        raise TraceFormatError(f"{where}: \"n_group\" must divide num_experts ({meta.num_experts}), got {meta.n_group!r}")
    if meta.topk_group is not None and (not _is_int(meta.topk_group) or not 1 <= meta.topk_group <= meta.n_group):
        raise TraceFormatError(f"{where}: \"topk_group\" must be in 1..n_group ({meta.n_group}), got {meta.topk_group!r}")


def load_object(text: str, where: str, position: bool = False) -> dict[str, Any]:
    """A JSON object from `text`, or a TraceFormatError naming `where` (and, with `position`, the
    line inside `text` where the JSON breaks: useful for whole files, noise for one JSONL line)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        at = f" at line {exc.lineno}" if position else ""
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg}{at})") from None
    if not isinstance(d, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(d).__name__}")
    return d


def parse_request(line: str, path: str | Path, lineno: int) -> RequestRecord:
    """One requests.jsonl line -> RequestRecord; `lineno` is 1-based, for the error message."""
    where = f"{path}: line {lineno}"
    d = load_object(line, where)
    for key, kind in (("id", str), ("domain", str), ("prompt_tokens", int), ("tokens", int)):
        if key not in d:
            raise TraceFormatError(f"{where}: missing field {key!r}")
        _expect(d, key, kind, where)
    if d["tokens"] < 0 or d["prompt_tokens"] < 0:
        raise TraceFormatError(
            f"{where}: negative token count (prompt_tokens {d['prompt_tokens']}, tokens {d['tokens']})"
        )
    if d["prompt_tokens"] > d["tokens"]:
        raise TraceFormatError(
            f"{where}: prompt_tokens {d['prompt_tokens']} > tokens {d['tokens']} (request {d['id']!r})"
        )
    for key in ("rank", *ADMISSION_FIELDS):
        if d.get(key) is not None:
            _expect(d, key, int, where)
            if d[key] < 0:
                raise TraceFormatError(f"{where}: negative {key} {d[key]} (request {d['id']!r})")
    admitted, released = d.get("admitted"), d.get("released")
    if admitted is not None and released is not None and released <= admitted:
        raise TraceFormatError(f"{where}: released {released} is not after admitted {admitted} (request {d['id']!r})")
    _expect(d, "aborted", bool, where, optional=True)
    moved = d.get("moved_tokens")
    if moved is not None and (d.get("decode_rank") is None or moved > d["tokens"]):
        raise TraceFormatError(f"{where}: moved_tokens {moved} needs a decode_rank and at most tokens {d['tokens']} "
                               f"(request {d['id']!r})")
    return RequestRecord(d["id"], d["domain"], d["prompt_tokens"], d["tokens"], d.get("rank"), admitted, released,
                         d.get("charge"), d.get("observed"), d.get("decode_rank"), moved, d.get("aborted", False))


def read_meta_json(trace_dir: str | Path) -> dict[str, Any]:
    """The raw meta.json object of a trace directory (either kind), with a clear error if unreadable."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        raise TraceFormatError(f"{trace_dir}: not a trace directory (does not exist or is not a directory)")
    path = trace_dir / META_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: missing (every trace directory has a meta.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFormatError(f"{path}: unreadable ({exc})") from None
    return load_object(text, str(path), position=True)


def trace_kind(trace_dir: str | Path) -> str:
    """'tokens' or 'counts', from meta.json (absent "kind" means a token trace)."""
    d = read_meta_json(trace_dir)
    kind = d.get("kind", KIND_TOKENS)
    if kind not in (KIND_TOKENS, KIND_COUNTS):
        raise TraceFormatError(
            f"{Path(trace_dir) / META_FILE}: unknown \"kind\" {kind!r} (expected {KIND_TOKENS!r} or {KIND_COUNTS!r})"
        )
    return kind


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


KIND_NAMES = {int: "an integer", bool: "true or false"}


def _expect(d: dict, key: str, kind: type, where: Any, optional: bool = False) -> None:
    if key not in d and optional:
        return
    value = d[key]
    ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise TraceFormatError(
            f"{where}: field {key!r} must be {KIND_NAMES.get(kind, 'a string')}, got {value!r}"
        )
