""".npy files whose row count is unknown until the end, and strict memory-mapped opening.

Writing: the header is written first with room to spare and rewritten with the true row count at
close, so rows stream straight to disk and are never copied (a trace can be larger than RAM).
The result is a plain NPY 1.0 file: np.load(path, mmap_mode="r") reads it.

Reading: the header is parsed and the file size checked against it before mapping, so a truncated
file is reported as such instead of surfacing as numpy's mmap error.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from locus.traces.format import TraceFormatError

# Magic (6) + version (2) + header length (2) + padded header dict: 128 bytes holds any row count
# (up to 20 digits) with any realistic row shape, and keeps the data 64-byte aligned like numpy does.
HEADER_BYTES = 128
_MAGIC = b"\x93NUMPY\x01\x00"


def _header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    descr = np.lib.format.dtype_to_descr(dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    body_len = HEADER_BYTES - len(_MAGIC) - 2
    if len(text) + 1 > body_len:
        raise ValueError(f"npy header for shape {shape} does not fit in {HEADER_BYTES} bytes")
    body = text.ljust(body_len - 1) + "\n"
    return _MAGIC + struct.pack("<H", body_len) + body.encode("latin1")


class NpyStream:
    """Append-only writer of a C-order .npy array [rows, *row_shape]."""

    def __init__(self, path: str | Path, dtype: np.dtype | str, row_shape: tuple[int, ...]):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.row_shape = tuple(row_shape)
        self.rows = 0
        self._file = open(self.path, "wb")
        self._file.write(_header(self.dtype, (0, *self.row_shape)))

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """The file's size once everything appended is written."""
        return HEADER_BYTES + self.rows * self.row_bytes

    def append(self, rows: np.ndarray) -> None:
        if rows.shape[1:] != self.row_shape:
            raise ValueError(
                f"{self.path.name}: rows of shape {rows.shape[1:]} appended to an array of rows {self.row_shape}"
            )
        self._file.write(np.ascontiguousarray(rows, dtype=self.dtype).tobytes())
        self.rows += rows.shape[0]

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.seek(0)
        self._file.write(_header(self.dtype, (self.rows, *self.row_shape)))
        self._file.close()

    def cut(self, rows: int) -> None:
        """After a failed write: drop the file's buffer, cut it back to its first `rows` rows and close it
        as a valid .npy of them. Needs no new disk space (the header is rewritten in place)."""
        try:
            self._file.close()  # what a full disk refused is lost either way
        except OSError:
            pass
        with open(self.path, "r+b") as f:
            f.truncate(HEADER_BYTES + rows * self.row_bytes)
            f.write(_header(self.dtype, (rows, *self.row_shape)))
        self.rows = rows


def open_npy(path: str | Path, dtype: np.dtype | str, ndim: int) -> np.ndarray:
    """Memory-map a .npy file read-only after checking its header, dtype, rank and byte count."""
    path = Path(path)
    want = np.dtype(dtype)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, got = np.lib.format.read_array_header_1_0(f)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, got = np.lib.format.read_array_header_2_0(f)
            else:
                raise TraceFormatError(f"{path}: unsupported .npy version {version}")
            offset = f.tell()
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: missing") from None
    except (ValueError, OSError, SyntaxError) as exc:
        raise TraceFormatError(f"{path}: not a valid .npy file ({exc})") from None
    if got != want:
        raise TraceFormatError(f"{path}: dtype is {got.str} ({got}), expected {want.str} ({want})")
    if fortran:
        raise TraceFormatError(f"{path}: Fortran-ordered arrays are not supported; write it C-ordered")
    if len(shape) != ndim:
        raise TraceFormatError(f"{path}: array has {len(shape)} dimensions {tuple(shape)}, expected {ndim}")
    expected = int(np.prod(shape, dtype=np.int64)) * want.itemsize
    actual = os.path.getsize(path) - offset
    if actual < expected:
        raise TraceFormatError(
            f"{path}: truncated: header says shape {tuple(shape)} ({expected} data bytes) but only {actual} bytes follow"
        )
    if actual > expected:
        raise TraceFormatError(f"{path}: {actual - expected} unexpected bytes after the {tuple(shape)} array")
    if expected == 0:  # mmap cannot map zero bytes; an empty array is just as good
        return np.zeros(shape, dtype=want)
    return np.memmap(path, dtype=want, mode="r", offset=offset, shape=tuple(shape))
