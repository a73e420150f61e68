"""Under expert parallelism a request is checked once, by rank 0's engine (issue 58, item 3): the rank it
is sent to admits the Add's validated request without checking it again. A rank's worker over the tiny
engine, without processes (`_add` reads only its engine)."""

from __future__ import annotations

from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.ep.ranks.messages import Add
from locus.engine.ep.ranks.worker import RankWorker
from locus.engine.sampling.sampler import SamplingParams


def test_a_rank_admits_an_add_without_validating_it(tiny, tok, monkeypatch):
    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=16))
    request = core.validate([1, 2, 3], SamplingParams(max_tokens=4, top_k=3))  # rank 0's one check
    checks = []
    monkeypatch.setattr(EngineCore, "validate", lambda self, *args: checks.append(args))
    worker = RankWorker.__new__(RankWorker)
    worker.core = core
    errors = []
    worker._add(Add("r", request.prompt_ids, request.params, None), errors)
    worker._add(Add("r", request.prompt_ids, request.params, None), errors)  # the engine still refuses an id in use
    assert checks == [] and list(core.requests) == ["r"]
    assert core.requests["r"].prompt_ids == [1, 2, 3] and core.requests["r"].params.top_k == 3
    assert errors == [("r", "request id 'r' is already in use")]
