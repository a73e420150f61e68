"""TraceWriter: stream requests into a locus-trace v1 directory.

Rows go straight to disk (NpyStream), so a trace larger than RAM can be written. Everything is
written into a hidden sibling directory that is renamed onto the target only by a successful
close(): an exception (or a crash) never leaves a valid-looking, half-written trace behind.

A writer that must survive a full disk (the engine's recorder) calls flush() after each request;
after a failed write, salvage() cuts every file back to the last flush and moves the requests written
until then into place. meta.json is written first, so finishing needs no new space beyond the plans.

Shape legend: n tokens of one request, N tokens of a batch of requests, L MoE layers, K top-k.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from locus.traces.format import (
    EPOCHS_FILE,
    IDS_FILE,
    META_FILE,
    PLANS_DIR,
    REQUESTS_FILE,
    TOKENS_FILE,
    WEIGHTS_FILE,
    RequestRecord,
    TraceFormatError,
    TraceMeta,
    plan_file,
)
from locus.traces.npyfile import NpyStream


def staging_dir(path: Path) -> Path:
    """Hidden sibling of `path` to build a trace in before the final rename."""
    return path.parent / f".{path.name}.partial-{os.getpid()}"


def replace_dir(staging: Path, path: Path, overwrite: bool) -> None:
    """Rename a finished staging directory onto `path` (replacing an old trace if allowed)."""
    if path.exists():
        if not overwrite:
            raise TraceFormatError(f"{path}: already exists (pass overwrite=True / --force to replace it)")
        if path.is_dir() and any(path.iterdir()) and not (path / META_FILE).exists():
            # Refuse to delete a directory that is not a trace: -o pointed at the wrong place.
            raise TraceFormatError(f"{path}: exists and is not a trace directory; refusing to replace it")
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, old)
        os.replace(staging, path)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.replace(staging, path)


def check_target(path: Path, overwrite: bool) -> None:
    """Fail early (before hours of generation) if `path` cannot be written later."""
    if path.exists() and not overwrite:
        raise TraceFormatError(f"{path}: already exists (pass overwrite=True / --force to replace it)")
    if path.exists() and not path.is_dir():
        raise TraceFormatError(f"{path}: exists and is not a directory; refusing to replace it")
    if not path.parent.is_dir():
        raise TraceFormatError(f"{path.parent}: parent directory does not exist")


class TraceWriter:
    """Context manager: `with TraceWriter(dir, meta) as w: w.add_request(...)`."""

    def __init__(self, path: str | Path, meta: TraceMeta, with_weights: bool = False, overwrite: bool = False,
                 with_epochs: bool = False, with_tokens: bool = False):
        self.path = Path(path)
        self.meta = meta
        self.with_weights = with_weights
        self.with_epochs = with_epochs
        self.with_tokens = with_tokens
        self.overwrite = overwrite
        check_target(self.path, overwrite)
        self._staging = staging_dir(self.path)
        if self._staging.exists():
            shutil.rmtree(self._staging)
        self._staging.mkdir()
        row = (meta.num_layers, meta.top_k)
        self._ids = self._weights = self._epochs = self._tokens = self._requests = None
        try:  # a disk that refuses even this leaves no staging directory behind
            self._ids = NpyStream(self._staging / IDS_FILE, np.int16, row)
            self._weights = NpyStream(self._staging / WEIGHTS_FILE, np.float16, row) if with_weights else None
            self._epochs = NpyStream(self._staging / EPOCHS_FILE, np.int32, ()) if with_epochs else None
            self._tokens = NpyStream(self._staging / TOKENS_FILE, np.int32, ()) if with_tokens else None
            self._requests = open(self._staging / REQUESTS_FILE, "wb")
            meta_text = (json.dumps(meta.to_json(), indent=1) + "\n").encode()
            (self._staging / META_FILE).write_bytes(meta_text)
        except BaseException:
            self._closed = False
            self.abort()
            raise
        self._meta_bytes = len(meta_text)
        self._requests_bytes = 0
        self._plans: dict[int, str] = {}
        self._seen_ids: set[str] = set()
        self.num_requests = 0
        self.num_tokens = 0
        self._closed = False
        self._flushed = self._mark()  # what salvage() keeps: the state as of the last flush()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add_request(
        self,
        id: str,
        domain: str,
        prompt_tokens: int,
        expert_ids: np.ndarray,
        expert_weights: np.ndarray | None = None,
        epochs: np.ndarray | None = None,
        token_ids: np.ndarray | None = None,
        aborted: bool = False,
    ) -> None:
        """Append one request; expert_ids [n, L, K] int (n = its tokens), expert_weights same shape,
        epochs [n] the placement epoch of each row (with_epochs writers), token_ids [n] the token each
        row fed the model (with_tokens writers); `aborted`: it ended before finishing (RequestRecord)."""
        n = int(np.shape(expert_ids)[0]) if np.ndim(expert_ids) == 3 else -1
        record = RequestRecord(str(id), str(domain), int(prompt_tokens), n, aborted=bool(aborted))
        self.add_requests([record], expert_ids, expert_weights, epochs, token_ids)

    def add_requests(
        self,
        records: Sequence[RequestRecord],
        expert_ids: np.ndarray,
        expert_weights: np.ndarray | None = None,
        epochs: np.ndarray | None = None,
        token_ids: np.ndarray | None = None,
    ) -> None:
        """Append several requests at once; expert_ids [N, L, K] holds their rows back to back."""
        if self._closed:
            raise RuntimeError(f"{self.path}: TraceWriter is closed")
        ids = np.asarray(expert_ids)
        want = (self.meta.num_layers, self.meta.top_k)
        if ids.ndim != 3 or ids.shape[1:] != want:
            raise TraceFormatError(
                f"{self.path}: expert_ids has shape {ids.shape}, expected [tokens, {want[0]}, {want[1]}]"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise TraceFormatError(f"{self.path}: expert_ids must be integers, got {ids.dtype}")
        total = sum(r.tokens for r in records)
        if total != ids.shape[0]:
            raise TraceFormatError(f"{self.path}: requests hold {total} tokens but expert_ids has {ids.shape[0]} rows")
        if ids.size and (ids.min() < -1 or ids.max() >= self.meta.num_experts):
            raise TraceFormatError(
                f"{self.path}: expert ids must lie in -1..{self.meta.num_experts - 1}, got range {ids.min()}..{ids.max()}"
            )
        weights = self._check_weights(expert_weights, ids.shape)
        epochs = self._check_epochs(epochs, ids.shape[0])
        token_ids = self._check_tokens(token_ids, ids.shape[0])
        batch_ids: set[str] = set()
        for r in records:  # check the whole batch before touching any state
            if r.prompt_tokens < 0 or r.prompt_tokens > r.tokens:
                raise TraceFormatError(
                    f"{self.path}: request {r.id!r}: prompt_tokens {r.prompt_tokens} not in 0..{r.tokens}"
                )
            if r.id in self._seen_ids or r.id in batch_ids:
                raise TraceFormatError(f"{self.path}: duplicate request id {r.id!r}")
            batch_ids.add(r.id)
        self._seen_ids |= batch_ids
        lines = "".join(json.dumps(r.to_json()) + "\n" for r in records).encode()
        self._requests_bytes += len(lines)
        self._requests.write(lines)
        self._ids.append(ids.astype(np.int16, copy=False))
        if self._weights is not None:
            self._weights.append(weights)
        if self._epochs is not None:
            self._epochs.append(epochs)
        if self._tokens is not None:
            self._tokens.append(token_ids)
        self.num_requests += len(records)
        self.num_tokens += ids.shape[0]

    def _check_weights(self, weights: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray | None:
        if self._weights is None:
            if weights is not None:
                raise TraceFormatError(
                    f"{self.path}: expert_weights given but the writer was opened with with_weights=False"
                )
            return None
        if weights is None:
            raise TraceFormatError(f"{self.path}: with_weights=True needs expert_weights for every request")
        w = np.asarray(weights)
        if w.shape != shape:
            raise TraceFormatError(f"{self.path}: expert_weights has shape {w.shape}, expected {shape} like expert_ids")
        return w.astype(np.float16, copy=False)

    def _check_epochs(self, epochs: np.ndarray | None, rows: int) -> np.ndarray | None:
        return self._check_per_row(epochs, rows, self._epochs, "epochs", "with_epochs", "the epoch")

    def _check_tokens(self, tokens: np.ndarray | None, rows: int) -> np.ndarray | None:
        t = self._check_per_row(tokens, rows, self._tokens, "token_ids", "with_tokens", "the token id")
        if t is not None and rows and self.meta.vocab_size is not None and t.max() >= self.meta.vocab_size:
            raise TraceFormatError(f"{self.path}: token id {int(t.max())} outside the vocabulary of {self.meta.vocab_size}")
        return t

    def _check_per_row(self, values, rows: int, stream, name: str, flag: str, what: str) -> np.ndarray | None:
        """One non-negative integer per row (epochs, token ids), given exactly when the writer keeps them."""
        if stream is None:
            if values is not None:
                raise TraceFormatError(f"{self.path}: {name} given but the writer was opened with {flag}=False")
            return None
        if values is None:
            raise TraceFormatError(f"{self.path}: {flag}=True needs {what} of every row")
        v = np.asarray(values)
        if v.shape != (rows,) or not np.issubdtype(v.dtype, np.integer) or (rows and v.min() < 0):
            raise TraceFormatError(f"{self.path}: {name} must be {rows} non-negative integers, one per row")
        return v.astype(np.int32, copy=False)

    def add_plan(self, epoch: int, plan: dict) -> None:
        """Keep the placement plan of `epoch` with the trace (plans/epoch-<e>.json); the same epoch
        may be added again only with the same plan."""
        if self._closed:
            raise RuntimeError(f"{self.path}: TraceWriter is closed")
        text = json.dumps(plan, indent=1) + "\n"
        if self._plans.get(int(epoch), text) != text:
            raise TraceFormatError(f"{self.path}: epoch {epoch} was given two different plans")
        self._plans[int(epoch)] = text

    @property
    def nbytes(self) -> int:
        """Bytes of the trace once everything added is written (plans apart)."""
        return self._meta_bytes + self._requests_bytes + sum(f.nbytes for f in self._streams())

    def request_bytes(self, id: str, domain: str, prompt_tokens: int, tokens: int, aborted: bool = False) -> int:
        """What add_request with these fields and `tokens` rows adds to nbytes."""
        record = RequestRecord(str(id), str(domain), int(prompt_tokens), int(tokens), aborted=bool(aborted))
        line = json.dumps(record.to_json()) + "\n"
        return len(line.encode()) + tokens * sum(f.row_bytes for f in self._streams())

    def flush(self) -> None:
        """Push everything added to the files (an OSError here means the disk refused it); salvage()
        keeps at least this much."""
        self._requests.flush()
        for f in self._streams():
            f.flush()
        self._flushed = self._mark()

    def salvage(self) -> bool:
        """After a failed write: keep the requests of the last flush() as a finished trace, in place.
        False (and nothing left behind) where there were none, or the trace could not be finished."""
        if self._closed:
            return False
        self._closed = True
        requests_bytes, rows, self.num_requests, self.num_tokens = self._flushed
        self._requests_bytes = requests_bytes
        try:
            try:
                self._requests.close()
            except OSError:
                pass
            os.truncate(self._staging / REQUESTS_FILE, requests_bytes)
            for f in self._streams():
                f.cut(rows)
            if self.num_requests == 0:
                raise OSError("nothing to keep")
            self._finish()
            return True
        except OSError:
            shutil.rmtree(self._staging, ignore_errors=True)
            self.num_requests = self.num_tokens = 0
            return False

    def close(self) -> None:
        """Finish the files and move the trace into place."""
        if self._closed:
            return
        self._closed = True
        try:
            self._requests.close()
            for f in self._streams():
                f.close()
            self._finish()
        except BaseException:
            shutil.rmtree(self._staging, ignore_errors=True)
            raise

    def _finish(self) -> None:
        if self._plans:
            (self._staging / PLANS_DIR).mkdir()
            for epoch, text in self._plans.items():
                (self._staging / plan_file(epoch)).write_text(text)
        replace_dir(self._staging, self.path, self.overwrite)

    def _streams(self) -> list[NpyStream]:
        return [f for f in (self._ids, self._weights, self._epochs, self._tokens) if f is not None]

    def _mark(self) -> tuple[int, int, int, int]:
        return self._requests_bytes, self._ids.rows, self.num_requests, self.num_tokens

    def abort(self) -> None:
        """Drop everything written so far; the target path is left as it was."""
        if self._closed:
            return
        self._closed = True
        for f in (self._requests, self._ids, self._weights, self._epochs, self._tokens):
            if f is not None:
                try:
                    f.close()
                except OSError:  # a full disk refusing the last buffer: it is deleted anyway
                    pass
        shutil.rmtree(self._staging, ignore_errors=True)
