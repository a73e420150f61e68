"""The router's assignment log (`locus-route-log`, version 1): which rank `locus route` sent each request
to, why, and the order of its admissions and releases, so that a replay can score the backends' traces
under that assignment and run the grouper through the same sequence (docs/design.md, "File formats").

JSON lines. The first is a header, then one line per event, in the order the router's grouper saw them:

    {"format": "locus-route-log", "version": 1, "plan": "...", "topology": {"nodes": 2, "gpus_per_node": 2},
     "backends": [{"url": "http://...", "ranks": [0]}, ...]}
    {"event": "admit", "seq": 0, "id": "r-1", "rank": 2, "domain": "code", "how": "tagged", "charge": 80,
     "prompt_tokens": 16, "streams": 1}
    {"event": "release", "seq": 1, "id": "r-1"}

`seq` numbers admissions and releases on one counter (the trace's `admitted` / `released`); `how` is
`tagged` (a domain the plan knows), `predicted` (the plan's prompt predictor placed it; `domain` is the
one it classified, or null when it placed it by predicted node cost) or `least-loaded`. A request
retried on another rank after its first one failed is admitted again under the same id: the last
admission is the one that ran.

A trace request is matched to its logged request by id: the same id, or the id an OpenAI-compatible
engine gives the request it was told (`X-Request-Id` / `request_id`): `cmpl-<id>`, `chatcmpl-<id>`,
with a `-<prompt index>` and a `#<choice>` suffix (Locus and vLLM name engine requests so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from locus.traces.format import Admission, TraceFormatError

FORMAT = "locus-route-log"
VERSION = 1
HOWS = ("tagged", "predicted", "least-loaded")
ENGINE_PREFIXES = ("cmpl-", "chatcmpl-")


@dataclass(frozen=True)
class LoggedRequest:
    """A request's last admission in the log, and its release."""

    id: str
    rank: int
    domain: str | None
    how: str
    admitted: int
    released: int | None
    charge: int
    prompt_tokens: int
    streams: int

    @property
    def admission(self) -> Admission:
        return Admission(self.admitted, self.released, self.charge)


@dataclass(frozen=True)
class RouteLog:
    path: Path
    header: dict
    requests: dict[str, LoggedRequest]  # by request id, in order of (last) admission

    def match(self, trace_id: str) -> LoggedRequest | None:
        """The logged request a trace request is (module docstring), None if the log has none."""
        for candidate in candidate_ids(trace_id):
            found = self.requests.get(candidate)
            if found is not None:
                return found
        return None


def candidate_ids(trace_id: str) -> list[str]:
    """The request ids a trace request id may stand for, the most literal first."""
    out = [trace_id]
    base = trace_id.rsplit("#", 1)[0] if "#" in trace_id else trace_id
    if base != trace_id:
        out.append(base)
    for prefix in ENGINE_PREFIXES:
        if base.startswith(prefix):
            rest = base[len(prefix):]
            out.append(rest)
            head, _, tail = rest.rpartition("-")
            if head and tail.isdigit():
                out.append(head)
    return out


def is_route_log(path: str | Path) -> bool:
    """Whether the file starts with a route log's header line."""
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16)
    except OSError:
        return False
    try:
        header = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT


def read_route_log(path: str | Path) -> RouteLog:
    """Parse a route log; any malformed line is refused with its line number."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceFormatError(f"cannot read route log {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise TraceFormatError(f"{path}: not a route log (not UTF-8 text)") from None
    if not lines:
        raise TraceFormatError(f"{path}: empty file, not a route log")
    header = _line(path, 1, lines[0])
    if header.get("format") != FORMAT:
        raise TraceFormatError(f"{path}: line 1 is not a {FORMAT} header")
    if header.get("version") != VERSION:
        raise TraceFormatError(f"{path}: route log version {header.get('version')!r} (this Locus reads {VERSION})")
    requests: dict[str, LoggedRequest] = {}
    for number, text in enumerate(lines[1:], start=2):
        if not text.strip():
            continue
        event = _line(path, number, text)
        kind, rid, seq = event.get("event"), event.get("id"), event.get("seq")
        if not isinstance(rid, str) or not _int(seq) or seq < 0:
            raise TraceFormatError(f"{path}: line {number}: an event needs a string \"id\" and an integer \"seq\" >= 0")
        if kind == "admit":
            rank, charge, prompt, streams = (event.get(k) for k in ("rank", "charge", "prompt_tokens", "streams"))
            if not all(_int(v) and v >= 0 for v in (rank, charge, prompt, streams)):
                raise TraceFormatError(f"{path}: line {number}: an admission needs integers rank, charge, "
                                       "prompt_tokens and streams >= 0")
            if event.get("how") not in HOWS:
                raise TraceFormatError(f"{path}: line {number}: \"how\" must be one of {', '.join(HOWS)}")
            requests.pop(rid, None)  # a retry: the last admission is the one that ran
            requests[rid] = LoggedRequest(rid, rank, event.get("domain"), event["how"], seq, None, charge, prompt,
                                          streams)
        elif kind == "release":
            found = requests.get(rid)
            if found is None:
                raise TraceFormatError(f"{path}: line {number}: release of {rid!r}, which was never admitted")
            requests[rid] = LoggedRequest(**{**found.__dict__, "released": seq})
        else:
            raise TraceFormatError(f"{path}: line {number}: unknown event {kind!r} (admit or release)")
    return RouteLog(path, header, requests)


class RouteLogWriter:
    """Appends events as they happen, one line each, flushed, so that a log read while the router runs
    (or after it was killed) holds every event up to the last whole line."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self._seq = 0
        self._file: IO[str] = open(self.path, "w", buffering=1 << 16)
        self._write({"format": FORMAT, "version": VERSION, **header})

    def admit(self, request_id: str, rank: int, domain: str | None, how: str, charge: int, prompt_tokens: int,
              streams: int) -> None:
        self._write({"event": "admit", "seq": self._tick(), "id": request_id, "rank": int(rank), "domain": domain,
                     "how": how, "charge": int(charge), "prompt_tokens": int(prompt_tokens), "streams": int(streams)})

    def release(self, request_id: str) -> None:
        self._write({"event": "release", "seq": self._tick(), "id": request_id})

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def _tick(self) -> int:
        self._seq += 1
        return self._seq - 1

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()


def _line(path: Path, number: int, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path}: line {number}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise TraceFormatError(f"{path}: line {number}: expected a JSON object")
    return value


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
