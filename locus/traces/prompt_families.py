"""Prompt families with disjoint alphabets: the domain-tagged workload of the expert-parallel benches
and tests on random-weight presets.

A preset's random router sends tokens of different byte alphabets to different experts, so each
family has its own expert usage, which is what a locality plan and its grouper exploit. One
definition, so that a bench and the test that checks it send the same kind of traffic.
"""

from __future__ import annotations

FAMILIES: dict[str, str] = {"code": "{}()[];=<>+-*/_", "math": "0123456789.^%!", "chat": "abcdefghijklmnopqrstuvwxyz "}


def family_prompt(family: str, i: int, min_chars: int = 16, step: int = 5, cycle: int = 7) -> str:
    """The i-th prompt of `family`: min_chars + step * (i % cycle) characters of its alphabet."""
    if family not in FAMILIES:
        raise ValueError(f"unknown prompt family {family!r} (choose {', '.join(FAMILIES)})")
    chars = FAMILIES[family]
    return "".join(chars[(i * 7 + j * j) % len(chars)] for j in range(min_chars + step * (i % cycle)))
