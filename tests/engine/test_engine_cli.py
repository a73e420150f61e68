"""The `locus` command as a user runs it: real subprocesses."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test runs `locus` as a subprocess


def locus(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_defaults_to_the_shipped_trained_model():
    r = locus("generate", "--prompt", "Hello", "--max-tokens", "8", "--seed", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello") and len(r.stdout.strip()) > len("Hello")
    assert "random weights" not in r.stderr
    assert r.stdout == locus("generate", "--model", "mini", "--prompt", "Hello", "--max-tokens", "8", "--seed", "0").stdout


def test_a_preset_says_its_weights_are_random():
    r = locus("generate", "--model", "tiny", "--prompt", "Hello", "--max-tokens", "8", "--seed", "0")
    assert r.returncode == 0 and "random weights" in r.stderr
    h = locus("generate", "--help").stdout.replace("\n", " ")
    assert "RANDOM" in h and "Default: 'mini'" in " ".join(h.split())


def test_init_model_then_generate_from_directory_is_deterministic(tmp_path):
    out = tmp_path / "tiny"
    r = locus("init-model", "--preset", "tiny", "--out", str(out), "--seed", "0")
    assert r.returncode == 0, r.stderr
    from_dir = locus("generate", "--model", str(out), "--prompt", "abc", "--max-tokens", "6")
    embedded = locus("generate", "--model", "tiny", "--prompt", "abc", "--max-tokens", "6")
    assert from_dir.returncode == 0 and from_dir.stdout == embedded.stdout


def test_sampling_with_seed_is_reproducible():
    a = locus("generate", "--prompt", "x", "--max-tokens", "12", "--temperature", "1.0", "--top-p", "0.9", "--seed", "7")
    b = locus("generate", "--prompt", "x", "--max-tokens", "12", "--temperature", "1.0", "--top-p", "0.9", "--seed", "7")
    assert a.returncode == 0 and a.stdout == b.stdout


def test_bad_model_path_is_one_clear_line(tmp_path):
    r = locus("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2
    assert "no such checkpoint directory" in r.stderr and "Traceback" not in r.stderr


def test_bad_sampling_parameter_is_rejected():
    r = locus("generate", "--prompt", "x", "--top-p", "0")
    assert r.returncode == 2 and "top_p" in r.stderr and "Traceback" not in r.stderr
