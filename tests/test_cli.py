"""The `locus` dispatcher: every error is one line without a traceback; `--debug`, anywhere on the
command line, adds the traceback (issue 41)."""

from __future__ import annotations

import pytest

from locus.cli import main, take_debug_flag


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.setenv("LOCUS_DEBUG", "0")  # main() sets it for the processes it starts; restored after


def test_debug_is_taken_wherever_it_stands_before_a_double_dash():
    assert take_debug_flag(["plan", "export", "--debug", "p.json"]) == (["plan", "export", "p.json"], True)
    assert take_debug_flag(["--debug", "serve"]) == (["serve"], True)
    assert take_debug_flag(["generate", "--", "--debug"]) == (["generate", "--", "--debug"], False)


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_bad_file_is_one_line_and_debug_adds_the_traceback(tmp_path, capsys, where):
    bad = tmp_path / "plan.json"
    bad.write_bytes(b"\xff\xfe{\x00")
    args = ["plan", "export", str(bad), "--to", "vllm", "-o", str(tmp_path / "v.json")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == f"locus: error: {bad}: not UTF-8 text (byte 0: invalid start byte) (it looks like UTF-16: save it as UTF-8)\n"
    assert main(["--debug", *args] if where == "before" else [*args, "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "PlanError" in err
    assert err.endswith(f"locus: error: {bad}: not UTF-8 text (byte 0: invalid start byte) (it looks like UTF-16: save it as UTF-8)\n")


def test_an_unexpected_error_is_one_line_naming_its_type(monkeypatch, tmp_path, capsys):
    import locus.routing.plan.placement as placement

    def broken(path):
        raise MemoryError

    monkeypatch.setattr(placement, "load_plan", broken)
    assert main(["plan", "export", str(tmp_path / "p.json"), "--to", "vllm", "-o", str(tmp_path / "v.json")]) == 1
    assert capsys.readouterr().err == "locus: error: MemoryError (run with --debug for the traceback)\n"
