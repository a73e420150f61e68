"""Building our C kernels (moe_cpu.c, argmax_cpu.c): compiled on first use with the system C compiler,
loaded through ctypes.

`cc -O3 -march=native -fopenmp -shared -fPIC` into LOCUS_KERNEL_CACHE (default
~/.cache/locus/kernels), one library per source, compiler and CPU (the file name hashes them), written
under a temporary name and renamed, so ranks starting together never load a half-written file. The
libraries link the libgomp that torch has loaded, so their OpenMP threads are torch's. No compiler,
or a failed build: one warning, and the caller falls back to torch. No Python dependency.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger("locus.kernels")

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def cache_dir() -> Path:
    return Path(os.environ.get("LOCUS_KERNEL_CACHE") or Path.home() / ".cache" / "locus" / "kernels")


def _cpu_signature() -> str:
    """What -march=native compiles for: the machine and its CPU feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


Signature = tuple[list, object]  # (argtypes, restype) of one exported function


def build(source: Path, what: str, fallback: str, signatures: dict[str, Signature] | None = None) -> ctypes.CDLL | None:
    """The library compiled from source, built if this machine has none yet, with each function in
    `signatures` given its argtypes and restype; None (after one warning naming `what` and the
    `fallback`) if it cannot be built. Callers cache the result."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s is unavailable, %s", what, fallback)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
        key = hashlib.sha256("\0".join([source.read_text(), *headers, compiler, version, *FLAGS,
                                        _cpu_signature()]).encode())
        target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([compiler, *FLAGS, "-o", tmp, str(source)], check=True, capture_output=True,
                               text=True, timeout=300)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("building %s failed (%s): %s", what, str(detail).strip()[:500], fallback)
        return None
    for name, (argtypes, restype) in (signatures or {}).items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib
