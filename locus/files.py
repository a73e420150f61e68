"""Writing result files so that a reader never sees half of one; reading JSON a user gives us."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write via a temporary file in the same directory, flushed to disk, then renamed over `path`:
    a reader sees the old file or the new one, even if this process is killed mid-write."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | Path, what: str = "file") -> object:
    """A JSON file's value, or a LocusError naming the file and what is wrong with it: unreadable, not
    UTF-8 (a UTF-16 file, say), not JSON, or nested deeper than the parser's recursion allows."""
    from locus.errors import LocusError

    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LocusError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        utf16 = raw[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(raw) > 1 and b"\x00" in raw[:4])
        hint = " (it looks like UTF-16: save it as UTF-8)" if utf16 else ""
        raise LocusError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}){hint}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LocusError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except RecursionError:
        raise LocusError(f"{path}: JSON nested too deeply to read") from None
    except ValueError as exc:  # e.g. an integer literal longer than Python converts (4300 digits)
        raise LocusError(f"{path}: not valid JSON ({exc})") from None


def directory_bytes(path: str | Path) -> int:
    """Bytes of the regular files under `path`, at any depth (symlinks are not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:  # gone since the listing
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total
