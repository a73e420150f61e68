"""Qwen3-MoE and DeepSeek-V3 / V2 engines in lockstep on real gloo process groups, 1x2 and 2x2 (with
replicas), on both transports (exact: counts first, then exactly the rows; fixed: capacity-sized blocks,
which the decode steps take), also overlapped (two micro-batches on two lanes) and with an MX dispatch
payload: every greedy token and the 5 likeliest tokens' log-probabilities at each step equal one engine's
(within 1e-5; with an MX payload, the agreement with the one-process stand-in is printed, as for
Llama-4), and the bytes the ranks measured equal, to the byte, `locus replay` of the trace they recorded,
in the payload's format (issue 57's acceptance for the new families; Llama-4's cases are
tests/engine/ep/test_expert_parallel.py, whose rank worker these cases run). The per-forward logits
checks of the same topologies are tests/engine/model/test_{qwen3,deepseek}_expert_parallel.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from locus.engine.checkpoint.presets import PRESETS
from locus.routing.replay.assignment import assign_recorded
from locus.routing.replay.simulator import replay
from locus.traces.merge import merge_traces
from locus.traces.reader import TraceReader
from tests.engine.ep.rank_cases import failures, run_cases, selected_params
from tests.engine.ep.test_expert_parallel import (engine_worker, plan_for, reference_generation,
                                                  top_logprobs)

pytestmark = pytest.mark.slow  # spawns up to 4 rank processes (once for all the cases)

PARAMS = ("preset", "case", "mode", "overlap", "dispatch_format")
CASES = [(preset, case, mode, False, "model") for preset in ("tiny-qwen3-moe", "tiny-deepseek-v3")
         for case in ("1x2", "2x2-replicas") for mode in ("exact", "fixed")]
# V2-Lite's router differs only in how it picks (greedy softmax); one case per topology and transport
CASES += [("tiny-deepseek-v2-lite", "1x2", "fixed", False, "model"),
          ("tiny-deepseek-v2-lite", "2x2-replicas", "exact", False, "model")]
CASES += [("tiny-deepseek-v3", "2x2-replicas", "fixed", True, "model"),  # overlapped
          ("tiny-qwen3-moe", "2x2-replicas", "exact", True, "model"),
          ("tiny-deepseek-v3", "2x2-replicas", "exact", False, "mxfp8"),  # MX dispatch payloads
          ("tiny-qwen3-moe", "2x2-replicas", "fixed", False, "mxint8")]


@pytest.fixture(scope="module")
def family_runs(request, tmp_path_factory) -> dict[tuple, Path]:
    """Every collected case, run in one launch of rank processes: its folder."""
    cases = selected_params(request, "test_family_engines_in_lockstep_generate_what_one_engine_does", PARAMS)
    launches = [(plan_for(params[1], PRESETS[params[0]].moe_layers, params[0]).topology.ranks, params)
                for params in cases]
    return dict(zip(cases, run_cases(engine_worker, launches, tmp_path_factory.mktemp("families"))))


@pytest.mark.parametrize(",".join(PARAMS), CASES)
def test_family_engines_in_lockstep_generate_what_one_engine_does(preset, case, mode, overlap, dispatch_format,
                                                                  family_runs):
    config = PRESETS[preset]
    plan = plan_for(case, config.moe_layers, preset)
    world = plan.topology.ranks
    folder = family_runs[preset, case, mode, overlap, dispatch_format]
    assert not failures(folder), failures(folder)
    got, measured = {}, []
    for rank in range(world):
        saved = torch.load(folder / f"engine{rank}.pt", weights_only=False)
        got.update(saved["finals"])
        measured.append(saved["bytes"])
        # the prefills (up to 32 tokens a step) go exact in both modes; the fixed mode's decode steps fixed
        assert saved["transports"] == ({"exact", "fixed"} if mode == "fixed" else {"exact"})
        S = plan.topology.slots_per_gpu  # each rank holds only its slots of each MoE layer
        assert saved["shapes"] == [(S, config.hidden_size, 2 * config.intermediate_size)] * len(config.moe_layers)

    want = reference_generation(preset, dispatch_format)
    assert len(got) == len(want) == 16
    if dispatch_format != "model":  # rounding boundaries cascade over steps (test_expert_parallel.py says how)
        identical = sum(got[f"p{i}"][0] == [out.outputs[0].token_ids] for i, out in enumerate(want))
        print(f"{preset} {case} {mode} {dispatch_format}: {identical} of 16 continuations identical to the stand-in's")
    for i, out in enumerate(want if dispatch_format == "model" else []):
        tokens, logprobs = got[f"p{i}"]
        assert tokens == [out.outputs[0].token_ids], f"request {i}"
        expected = [top_logprobs(lp) for lp in out.outputs[0].logprobs]
        assert [[t for t, _ in step] for step in logprobs[0]] == [[t for t, _ in step] for step in expected]
        assert np.allclose([[v for _, v in step] for step in logprobs[0]],
                           [[v for _, v in step] for step in expected], atol=1e-5)

    # the bytes the ranks measured are replay's of their trace, plan and the rank each request ran on
    merge_traces([folder / f"trace{r}" for r in range(world)], folder / "trace", ranks=list(range(world)))
    reader = TraceReader(folder / "trace")
    assert reader.meta.moe_layers == tuple(config.moe_layers)
    report = replay(reader, plan, plan.topology, assign_recorded(reader.requests, world),
                    dispatch_format=dispatch_format)
    assert report.tokens * len(plan.moe_layers) == sum(b.token_layers for b in measured)
    assert sum(b.inter_node for b in measured) == report.inter_node_bytes
    assert sum(b.intra_node for b in measured) == report.intra_node_bytes
    assert report.intra_node_bytes > 0 and (report.inter_node_bytes > 0) == (plan.topology.nodes > 1)
