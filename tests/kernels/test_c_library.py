"""Building a C source into a cached library (locus/kernels/c_library.py), on real files."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from locus.kernels import c_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


def test_a_header_change_rebuilds(tmp_path, monkeypatch):
    """The library's name hashes the headers beside the source: editing one builds a new library,
    and the old one is never loaded for the new code."""
    monkeypatch.setenv("LOCUS_KERNEL_CACHE", str(tmp_path / "cache"))
    src, header = tmp_path / "answer.c", tmp_path / "value.h"
    src.write_text('#include "value.h"\nint locus_answer(void) { return VALUE; }\n')
    header.write_text("#define VALUE 41\n")
    first = c_library.build(src, "the test kernel", "no fallback")
    assert first.locus_answer() == 41
    header.write_text("#define VALUE 42\n")
    second = c_library.build(src, "the test kernel", "no fallback")
    assert second.locus_answer() == 42
    assert len(list((tmp_path / "cache").glob("answer-*.so"))) == 2
    again = c_library.build(src, "the test kernel", "no fallback")  # reused, not rebuilt
    assert isinstance(again, ctypes.CDLL) and len(list((tmp_path / "cache").iterdir())) == 2
