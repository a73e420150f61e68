"""The decode graphs' static-buffer runner without a compiler (decode_graph.py, decode_inputs.py): the
buffer logic every captured CUDA graph depends on, checked on CPU in float32 against the eager engine
for every bucket, with the gathered attention and with the paged kernel (interpreted), and a forward
that never makes the host wait (the CPU stand-in for CUDA's sync debug mode)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from locus.engine.checkpoint.presets import build_preset
from locus.engine.runner.decode_graph import DecodeGraphs
from locus.engine.runner.decode_inputs import DecodeInputs
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.sampling.sampler import SamplingParams
from locus.kernels import fused_moe
from tests.engine.sync_guard import record_syncs
from tests.engine.runner.test_decode_graph import check_biased_rows_and_scoring_requests, check_decode_steps, run_to_completion
from tests.engine.core.test_engine import random_prompts


def engine_with_graphs(model, tok, buckets, paged=False, **config) -> EngineCore:
    """An eager engine whose decode steps then go through uncompiled, uncaptured decode graphs."""
    core = EngineCore(model, tok, EngineConfig(block_size=16, **config))
    max_blocks = -(-min(core.max_model_len, core.pool_tokens) // 16)
    core.graphs = core.runner.graphs = DecodeGraphs(model, core.cache, list(buckets), max_blocks, compile=False,
                                                    paged=paged)
    core.graphs.warm_up()
    return core


def staggered(count: int, first: int, step: int) -> list[SamplingParams]:
    """Greedy requests that finish one after another, so the decode batch shrinks through the buckets."""
    return [SamplingParams(temperature=0.0, max_tokens=first + step * i, ignore_eos=True) for i in range(count)]


def test_every_bucket_gives_the_eager_logits_and_tokens(tiny, tok, monkeypatch):
    """8 sequences finishing one by one run in buckets 8, 4, 2 and 1 (padding 0-3 rows), contexts
    crossing block boundaries and the 64-token attention chunks; logits within 1e-5 of the eager
    runner at every step, and the greedy tokens of the whole run equal the eager engine's."""
    core = engine_with_graphs(tiny, tok, (1, 2, 4, 8), num_kv_blocks=64, max_num_seqs=8)
    checked = check_decode_steps(core, monkeypatch)
    prompts = random_prompts(8, 50, 62, seed=11)
    params = staggered(8, 3, 2)
    fast = run_to_completion(core, prompts, params)
    assert {core.graphs.bucket(n) for n in checked} == {1, 2, 4, 8}
    eager = EngineCore(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=8))
    slow = run_to_completion(eager, prompts, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]


def test_biased_rows_do_not_take_the_graphs_argmax(tiny, tok):
    """The runner every CUDA graph captures hands the sampler its argmax of the unbiased logits:
    logit_bias rows (banned, forced) sample from the biased ones beside an unbiased row that takes it."""
    check_biased_rows_and_scoring_requests(engine_with_graphs(tiny, tok, (1, 4), num_kv_blocks=64, max_num_seqs=4))


def test_paged_attention_in_the_graph_gives_the_eager_logits(tiny, tok, monkeypatch):
    """The CUDA path's attention (the paged kernel over full-width tables) under Triton's interpreter:
    three sequences whose contexts cross the 64-token chunk boundary, buckets 2 and 4."""
    core = engine_with_graphs(tiny, tok, (2, 4), paged=True, num_kv_blocks=32, max_num_seqs=4)
    assert core.graphs.inputs.args(4).block_tables.shape == (4, core.graphs.inputs.max_width)  # read in place
    checked = check_decode_steps(core, monkeypatch)
    run_to_completion(core, random_prompts(3, 58, 62, seed=12), staggered(3, 4, 4))
    assert {core.graphs.bucket(n) for n in checked} == {2, 4}


def test_the_decode_forward_never_waits_for_the_device(tok):
    """What the captured graph holds (paged attention, the Triton experts, the greedy argmax) calls
    nothing that reads a value back or sizes a tensor by its data; the guard does see such calls
    (the torch reference MoE counts its experts' rows on the host)."""
    model = build_preset("tiny", seed=0, moe_backend="triton")
    core = engine_with_graphs(model, tok, (4,), paged=True, num_kv_blocks=16, max_num_seqs=4)
    graphs = core.graphs
    forward_syncs = []
    call = graphs._call

    def guarded(args):
        with record_syncs() as found:
            out = call(args)
        forward_syncs.extend(found)
        return out

    graphs._call = guarded
    run_to_completion(core, random_prompts(3, 5, 20, seed=13), [SamplingParams(temperature=0.0, max_tokens=4)] * 3)
    assert graphs.steps >= 3 and forward_syncs == []

    block = model.model.layers[0].feed_forward
    with record_syncs() as found:
        fused_moe(torch.randn(3, 64), block.experts.gate_up_proj, block.experts.down_proj,
                  torch.tensor([[0, 1], [2, 3], [1, 5]]), torch.rand(3, 2), backend="torch")
    assert {"Tensor.tolist", "boolean-mask index"} <= {what for what, _ in found}


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_inputs_are_staged_as_the_graph_reads_them(staged):
    """Token ids, positions, KV write rows and context lengths per row; padding rows at position -1
    writing the scratch block; tables scratch-padded to the step's widest; too wide a table refused.
    `staged` runs the GPU's layout (a staging area copied over, alternating areas) on the CPU."""
    inputs = DecodeInputs(max_batch=4, max_width=6, block_size=16, scratch_block=99, device=torch.device("cpu"),
                          staged=staged)
    inputs.tables.fill_(7)  # stale ids from earlier steps
    inputs.stage([1, 2], [3, 4], [[5], [6]], B=2)  # an earlier step in the other staging area
    inputs.commit(2)
    W = inputs.stage([5, 6, 8], [0, 17, 40], [[3], [4, 9], [1, 2, 11]], B=4)
    inputs.commit(4)
    assert W == 3
    args = inputs.args(4, W)
    assert args.input_ids.tolist() == [5, 6, 8, 0] and args.positions.tolist() == [0, 17, 40, -1]
    assert args.write_rows.tolist() == [3 * 16, 9 * 16 + 1, 11 * 16 + 8, 99 * 16]
    assert args.context_lens.tolist() == [1, 18, 41, 0]
    assert args.block_tables.tolist() == [[3, 99, 99], [4, 9, 99], [1, 2, 11], [99, 99, 99]]
    assert np.all(inputs.tables[:, 3:].numpy() == 7)  # past the step's width: untouched, never read
    assert inputs.args(2).block_tables.shape == (2, 6)
    with pytest.raises(ValueError, match="exceeds the decode graphs' width"):
        inputs.stage([1], [0], [[0] * 7], B=1)


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_rows_fed_from_the_previous_step_take_its_sampled_ids_on_the_device(staged):
    """The overlapped schedule stages a placeholder for a token still on the device and its row in the
    previous step's sampled ids; after the commit, `feed` puts that token in; the other rows and the
    padding keep what the host staged."""
    inputs = DecodeInputs(max_batch=4, max_width=4, block_size=16, scratch_block=9, device=torch.device("cpu"),
                          staged=staged)
    inputs.stage([5, 0, 0], [3, 7, 2], [[1], [2], [3]], B=4, sources=[-1, 1, 0])
    inputs.commit(4)
    inputs.feed(3, torch.tensor([70, 71], dtype=torch.long))
    args = inputs.args(4, 2)
    assert args.input_ids.tolist() == [5, 71, 70, 0] and args.positions.tolist() == [3, 7, 2, -1]
    inputs.stage([6, 8], [4, 8], [[1], [2]], B=2)  # no feed: every row is the host's
    inputs.commit(2)
    assert inputs.args(2, 2).input_ids.tolist() == [6, 8] and inputs.meta[4, :2].tolist() == [-1, -1]
