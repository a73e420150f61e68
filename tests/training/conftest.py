"""A tiny fake package tree (fortunes, Python and C sources) that the corpus builder reads like the real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from locus.training.corpus import CorpusSpec

EN = ["A penny saved is a penny earned.", "The early bird catches the worm.", "Time flies like an arrow.",
      "Fruit flies like a banana.", "All that glitters is not gold.", "Actions speak louder than words."]
DE = ["Morgenstund hat Gold im Mund.", "Wer rastet, der rostet.", "Übung macht den Meister.",
      "Ende gut, alles gut.", "Der Apfel fällt nicht weit vom Stamm."]
PY = '''import os


def add(a, b):
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self):
        self.n = 0

    def tick(self):
        self.n += 1
        return self.n
'''
C = '''#ifndef FAKE_H
#define FAKE_H

struct point { int x; int y; };

int add(int a, int b);

#endif
'''


def make_tree(root: Path, repeat: int = 1) -> CorpusSpec:
    fortunes = root / "fortunes"
    (fortunes / "de").mkdir(parents=True)
    (fortunes / "off").mkdir()
    (fortunes / "proverbs").write_text("\n%\n".join(EN * repeat) + "\n%\n")
    (fortunes / "proverbs.dat").write_bytes(b"\x00\x01binary index")
    (fortunes / "proverbs.u8").symlink_to("proverbs")
    (fortunes / "off" / "rude").write_text("not read\n%\n")
    (fortunes / "de" / "sprichwoerter").write_text("\n%\n".join(DE * repeat) + "\n%\n")
    python = root / "python"
    (python / "pkg").mkdir(parents=True)
    (python / "test").mkdir()
    for i in range(repeat):
        (python / "pkg" / f"mod{i}.py").write_text(PY.replace("add", f"add{i}"))
    (python / "test" / "test_skipped.py").write_text("assert False\n")
    c = root / "include"
    (c / "sys").mkdir(parents=True)
    for i in range(repeat):
        (c / "sys" / f"fake{i}.h").write_text(C.replace("add", f"add{i}"))
    return CorpusSpec(fortune_root=fortunes, python_root=python, c_root=c, c_packages=None,
                      dpkg_info=root / "no-dpkg", max_bytes=200_000, math_docs=200, seed=0)


@pytest.fixture
def fake_tree(tmp_path) -> CorpusSpec:
    return make_tree(tmp_path)
