"""The prompts of the expert-parallel benches for a trained model (bench/serve_lib/domain_text.py,
bench/ep.py's prompt_source), bench/ep_network.py's decode-step rate calibration and its node pinning."""

from __future__ import annotations

import argparse
import sys

import pytest

from tests.bench.bench_scripts import BENCH

sys.path.insert(0, str(BENCH))
from ep import prompt_source, workload  # noqa: E402
from ep_network import auto_rates, node_cpus  # noqa: E402
from serve_lib.common import BenchError  # noqa: E402
from serve_lib.domain_text import DomainText  # noqa: E402

from locus.engine.checkpoint.loader import shipped_model  # noqa: E402


def args(model: str, prompts: str = "auto", corpus: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(model=model, prompts=prompts, corpus=corpus, prompt_tokens=32)


@pytest.mark.skipif(shipped_model("mini") is None, reason="the shipped mini checkpoint is not installed")
def test_mini_gets_held_out_text_by_domain_planning_and_measured_disjoint():
    text = prompt_source(args("mini"))
    assert isinstance(text, DomainText)
    domains = set(text.measured)
    assert {"en", "de", "python", "c", "math"} <= domains
    planned = {p for _, p in text.take(200, 0, planning=True)}
    measured = {p for _, p in text.take(200, 0)}
    assert planned and measured and not planned & measured  # the plan never sees the measured text
    first = text.take(len(domains) * 2, 0)
    assert [d for d, _ in first] == list(text.measured) * 2  # the domains in turn
    assert len({p for _, p in first}) == len(first)
    # consecutive offsets continue where the last run stopped: no prompt sent twice until a pool wraps
    assert not {p for _, p in text.take(7, 0)} & {p for _, p in text.take(7, 7)}
    assert workload(7, 7, text=text) == text.take(7, 7)


def test_a_random_preset_gets_the_synthetic_families():
    assert prompt_source(args("small")) is None
    assert prompt_source(args("mini", prompts="families")) is None


def test_text_prompts_for_a_model_without_text_say_what_is_missing(tmp_path):
    with pytest.raises(BenchError, match="heldout_sample.json"):
        DomainText.load(tmp_path, None, 32)
    with pytest.raises(SystemExit, match="heldout_sample.json"):
        prompt_source(args(str(tmp_path), prompts="text"))


def test_rates_put_the_link_at_a_quarter_half_and_three_quarters_of_the_decode_step():
    # 40 ms decode step, 10,000 bytes a step on the link: X / (40 ms + X) = s
    rates = auto_rates({"decode_step_ms": 40.0, "decode_link_bytes_per_step": 10_000})
    kbit = [int(r.removesuffix("kbit")) for r in rates]
    for share, rate in zip((0.25, 0.5, 0.75), kbit):
        link_s = 10_000 * 8 / (rate * 1000)
        assert link_s / (0.040 + link_s) == pytest.approx(share, rel=0.01)


def test_pinned_nodes_get_disjoint_equal_shares_of_the_cores(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 5})
    pinned = argparse.Namespace(pin_nodes=True, nodes=2)
    assert node_cpus(0, pinned) == ["taskset", "-c", "0,1"]
    assert node_cpus(1, pinned) == ["taskset", "-c", "2,3"]
    assert node_cpus(1, argparse.Namespace(pin_nodes=False, nodes=2)) == []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7})
    with pytest.raises(SystemExit, match="at least one CPU per node"):
        node_cpus(0, pinned)
