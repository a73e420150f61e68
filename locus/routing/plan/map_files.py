"""Reading and writing other engines' expert-map files: JSON (nested lists) or torch.save (.pt), by extension.

SGLang's `--init-expert-location` decides the same way (`.pt` -> torch.load, `.json` -> json), so the
extension is the whole contract. torch is imported only when a `.pt` file is read or written.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from locus.errors import LocusError
from locus.files import read_json, write_text_atomic

EXTENSIONS = (".json", ".pt")


def map_file_kind(path: str | Path) -> str:
    """'.json' or '.pt'; anything else is refused before any work is done."""
    suffix = Path(path).suffix.lower()
    if suffix not in EXTENSIONS:
        raise LocusError(f"{path}: unknown file type {suffix or '(none)'!r}; use a .json or .pt file name")
    return suffix


def save_map_file(path: str | Path, data: dict[str, Any] | tuple) -> None:
    """Write `data` (a dict, or a tuple for DeepSeek's triple) atomically; arrays become lists or int64 tensors."""
    path = Path(path)
    kind = map_file_kind(path)
    if not path.parent.is_dir():
        raise LocusError(f"cannot write {path}: directory {path.parent} does not exist")
    try:
        if kind == ".json":
            write_text_atomic(path, json.dumps(_jsonable(data)) + "\n")
        else:
            _save_torch_atomic(path, _tensors(data))
    except OSError as exc:
        raise LocusError(f"cannot write {path}: {exc.strerror or exc}") from None


def load_map_file(path: str | Path) -> Any:
    """The decoded file: dicts/lists from JSON, dicts/tuples of tensors from .pt (weights_only, no pickled code)."""
    path = Path(path)
    kind = map_file_kind(path)
    if not path.is_file():
        raise LocusError(f"{path}: no such file")
    if kind == ".json":
        return read_json(path, "expert map")
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file; all mean "not a torch.save file"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise LocusError(f"{path}: not a readable torch.save file ({type(exc).__name__}: {first})") from None


def int_array(value: Any, path: str | Path, name: str, ndim: int) -> np.ndarray:
    """`value` (tensor or nested lists) as an int64 array of `ndim` dimensions, or a LocusError naming it."""
    if hasattr(value, "detach"):  # a torch tensor; checked by dtype, not converted blindly
        if value.dtype.is_floating_point or value.dtype.is_complex or str(value.dtype) == "torch.bool":
            raise LocusError(f"{path}: {name} holds {value.dtype} values, expected integers")
        array = value.detach().cpu().numpy()
    else:
        try:
            array = np.asarray(value)
        except ValueError:  # ragged nested lists
            raise LocusError(f"{path}: {name} is not a rectangular array") from None
    if array.dtype == object:
        raise LocusError(f"{path}: {name} is not a rectangular array of integers")
    if array.ndim != ndim:
        raise LocusError(f"{path}: {name} has {array.ndim} dimension(s) {list(array.shape)}, expected {ndim}")
    if array.size == 0:
        raise LocusError(f"{path}: {name} is empty (shape {list(array.shape)})")
    if array.dtype.kind not in "iu":
        raise LocusError(f"{path}: {name} holds {array.dtype} values, expected integers")
    return array.astype(np.int64)


def _jsonable(data: Any) -> Any:
    if isinstance(data, np.ndarray):
        return data.tolist()
    if isinstance(data, dict):
        return {k: _jsonable(v) for k, v in data.items()}
    if isinstance(data, (tuple, list)):
        return [_jsonable(v) for v in data]
    return data


def _tensors(data: Any) -> Any:
    import torch

    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(data, dtype=np.int64))
    if isinstance(data, dict):
        return {k: _tensors(v) for k, v in data.items()}
    if isinstance(data, tuple):
        return tuple(_tensors(v) for v in data)
    return data


def _save_torch_atomic(path: Path, obj: Any) -> None:
    """torch.save via a temporary file in the same directory, renamed over `path` (see locus.files)."""
    import torch

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
