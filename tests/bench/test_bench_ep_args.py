"""bench/ep.py --expert-cap: passed to every `locus plan` the bench runs (none by default), and a bad one
refused before the planning trace is recorded."""

import sys

import pytest

from tests.bench.bench_scripts import BENCH

sys.path.insert(0, str(BENCH))

import ep  # noqa: E402


class Planned(Exception):
    """Stops the bench at its first `locus plan` (no servers in a fast test)."""


def _plan_calls(monkeypatch, work, argv: list[str]) -> list[list[str]]:
    calls = []
    monkeypatch.setattr(ep, "prompt_source", lambda args: None)
    monkeypatch.setattr(ep, "record_planning_trace", lambda *a, **k: None)
    monkeypatch.setattr(ep.tempfile, "mkdtemp", lambda prefix: str(work))

    def locus(*args, timeout=600):
        calls.append(list(args))
        raise Planned

    monkeypatch.setattr(ep, "locus", locus)
    with pytest.raises(Planned):
        ep.main(argv)
    return calls


@pytest.mark.parametrize("extra, cap", [((), None), (("--expert-cap", "eplb"), "eplb"),
                                        (("--expert-cap", "eplb:0.25"), "eplb:0.25"), (("--expert-cap", "1.2"), "1.2")])
def test_every_plan_is_made_with_the_expert_cap_given(monkeypatch, tmp_path, extra, cap):
    (first,) = _plan_calls(monkeypatch, tmp_path, ["--model", "tiny", "--plans", "eplb,locality", *extra])
    assert first[:2] == ["plan", first[1]] and first[first.index("--planner") + 1] == "eplb"
    args = ep.parse_args(["--plans", "round_robin,eplb,locality,locality_placement", *extra])
    for name, planner in (("round_robin", "round_robin"), ("eplb", "eplb"), ("locality", "locality"),
                          ("locality_placement", "locality")):
        cmd = ep.plan_command(args, name, tmp_path / "planning", tmp_path / f"{name}.json")
        assert cmd[cmd.index("--planner") + 1] == planner and cmd[-2:] == ["-o", str(tmp_path / f"{name}.json")]
        if cap is None:
            assert "--expert-cap" not in cmd and "--expert-cap" not in first  # the planner's own default
        else:
            assert cmd[cmd.index("--expert-cap") + 1] == cap and first[first.index("--expert-cap") + 1] == cap


@pytest.mark.parametrize("cap, message", [("eplb:2", "the share of EPLB's slack must be in [0, 1]"),
                                          ("tight", "must be a number or auto[:FLOOR] or eplb[:SHARE]")])
def test_a_bad_expert_cap_stops_the_bench_before_any_work(monkeypatch, cap, message):
    monkeypatch.setattr(ep, "record_planning_trace", lambda *a, **k: pytest.fail("recorded before the check"))
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        ep.main(["--model", "tiny", "--expert-cap", cap])
