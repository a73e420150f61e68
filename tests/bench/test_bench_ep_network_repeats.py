"""bench/ep_network.py --unshaped-repeats: the unshaped link repeated fewer times than the shaped rates,
with the prompts a full run would send at each rate, and a bad count refused before the network is built."""

import argparse
import subprocess
import sys

from tests.bench.bench_scripts import BENCH

sys.path.insert(0, str(BENCH))

import ep_network  # noqa: E402


class Link:
    def shape(self, rate):
        self.rate = rate


def test_unshaped_repeats_apply_to_the_unshaped_link_only(monkeypatch):
    sent = []

    def measure(net, cluster, model, jobs, untagged=False):
        sent.append((net.rate, jobs[0].prompt))
        return {"tpot_p50_ms": 1.0, "out_tok_s": 1.0, "step_ms": 1.0, "exchange": 0.5, "steps": 1}

    monkeypatch.setattr(ep_network, "measure", measure)
    args = argparse.Namespace(workloads="wave", repeats=4, unshaped_repeats=1, streams=2, mixed_requests=0,
                              output_len=4, untagged=False)
    unshaped = ep_network.measure_rate(Link(), None, "m", args, "eplb", False, None, 0, None)
    shaped = ep_network.measure_rate(Link(), None, "m", args, "eplb", False, "948kbit", 1, None)
    assert len(unshaped[0]["runs"]) == 1 and len(shaped[0]["runs"]) == 4
    # the shaped rate's prompts start where they would after 4 unshaped repeats: offsets 8, 10, 12, 14
    full = argparse.Namespace(**{**vars(args), "unshaped_repeats": None})
    sent_before = list(sent)
    sent.clear()
    ep_network.measure_rate(Link(), None, "m", full, "eplb", False, "948kbit", 1, None)
    assert sent == sent_before[1:]


def test_a_bad_unshaped_repeats_is_refused_before_the_network_is_built():
    done = subprocess.run([sys.executable, str(BENCH / "ep_network.py"), "--unshaped-repeats", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--unshaped-repeats 0" in done.stderr and "namespace" not in done.stderr
