"""One routing tap per step: one host copy per micro-batch shared by every subscriber, recording
only while someone subscribes, and no subscriber switched off by another's leaving."""

from __future__ import annotations

import numpy as np

from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.observers.routing_tap import RoutingTap
from locus.engine.sampling.sampler import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def run_all(core: EngineCore) -> None:
    while core.has_unfinished():
        core.step()


def spy_on_runs(core: EngineCore) -> list[bool]:
    flags: list[bool] = []
    real = core.runner.run

    def run(items, record_routing=False, **kwargs):
        flags.append(record_routing)
        return real(items, record_routing=record_routing, **kwargs)

    core.runner.run = run
    return flags


def test_every_subscriber_gets_the_same_single_host_copy(tiny, tok, tmp_path, monkeypatch):
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))  # expert-load counters on
    copies, seen_a, seen_b = [], [], []
    real_capture = RoutingTap.capture
    monkeypatch.setattr(RoutingTap, "capture", lambda self, *a: copies.append(real_capture(self, *a)) or copies[-1])
    core.routing.subscribe(seen_a.append)
    core.routing.subscribe(seen_b.append)
    core.start_recording(tmp_path / "trace", "tiny")
    core.add_request("r", [1, 2, 3, 4, 5], PARAMS)
    run_all(core)
    assert len(copies) == 4  # one prefill and three decode micro-batches: one capture each
    assert [id(s) for s in seen_a] == [id(s) for s in seen_b] == [id(s) for s in copies]
    first = copies[0]
    assert first.ids.shape == (5, len(tiny.config.moe_layers), tiny.config.num_experts_per_tok)
    assert first.ids.dtype == np.int16 and first.weights.dtype == np.float16
    # the counters behind /metrics saw exactly the pairs the subscribers saw
    counted = sum(sum(v) for v in core.expert_load.snapshot().values())
    assert counted == sum(int((s.ids >= 0).sum()) for s in copies)


def test_routing_is_recorded_only_while_someone_subscribes(tiny, tok, tmp_path):
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64, count_expert_load=False))
    flags = spy_on_runs(core)
    core.add_request("quiet", [1, 2, 3], PARAMS)
    run_all(core)
    assert flags and not any(flags)

    grouper_like: list = []
    core.routing.subscribe(grouper_like.append)
    core.start_recording(tmp_path / "trace", "tiny")
    core.dump_recording()  # the recorder leaves; the other subscriber must keep its routing
    flags.clear()
    core.add_request("loud", [4, 5, 6], PARAMS)
    run_all(core)
    assert flags and all(flags) and len(grouper_like) == len(flags)
    core.routing.unsubscribe(grouper_like.append)
    assert not core.routing.active
