"""Decode graphs on a GPU: real torch.cuda.CUDAGraph captures replay what the eager runner computes,
no bucket is left uncaptured, the compiled forward captures too, and the uncaptured forward never
makes the host wait (CUDA's sync debug mode). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from locus.engine.checkpoint.presets import build_preset
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.runner.decode_graph import DecodeGraphs
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.sampling.sampler import SamplingParams
from tests.engine.runner.test_decode_graph import check_biased_rows_and_scoring_requests, check_decode_steps, run_to_completion
from tests.engine.core.test_engine import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# The graph's attention is the paged Triton kernel, the eager runner's is SDPA: float32 sums in another
# order, so the logits agree to float32 rounding of the longer reductions, not bit for bit.
GPU_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_cuda():
    return build_preset("tiny", seed=0, device="cuda", moe_backend="auto")


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer(ByteTokenizer.MIN_VOCAB)


def config(**kw) -> EngineConfig:
    return EngineConfig(block_size=16, num_kv_blocks=96, max_num_seqs=8, **kw)


def generate(core: EngineCore, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run_to_completion(core, prompts, params)]


def staggered(count: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(count)]


@pytest.mark.parametrize("compile_decode,buckets", [(False, (1, 2, 4, 8)), (True, (2, 8))],
                         ids=["captured", "compiled+captured"])
def test_captured_graphs_replay_the_eager_logits_in_every_bucket(tiny_cuda, tok, monkeypatch, compile_decode, buckets):
    """8 sequences finishing one by one (batches of 8 down to 1) over contexts crossing blocks and
    the 64-token chunks: every bucket captured, each replay's logits against the eager runner on the
    same KV state, and the greedy tokens of the run equal to an --enforce-eager engine's."""
    core = EngineCore(tiny_cuda, tok, config(compile_decode=compile_decode, compile_buckets=buckets))
    graphs = core.graphs
    assert graphs.capture and graphs.paged and graphs.skipped == {} and graphs.captured == list(buckets)
    checked = check_decode_steps(core, monkeypatch, atol=GPU_ATOL)
    prompts = random_prompts(8, 50, 70, seed=21)
    fast = generate(core, prompts, staggered(8))
    assert {graphs.bucket(n) for n in checked} == set(buckets)
    eager = EngineCore(tiny_cuda, tok, config(enforce_eager=True))
    assert eager.graphs is None
    assert fast == generate(eager, prompts, staggered(8))


def test_biased_rows_do_not_take_the_captured_argmax(tiny_cuda, tok):
    """A captured graph hands over its argmax of the unbiased logits: logit_bias rows sample from the
    biased logits beside rows that take it, and a scoring-only request never replays a graph."""
    core = EngineCore(tiny_cuda, tok, config())
    assert core.graphs.capture
    check_biased_rows_and_scoring_requests(core)


def test_graphs_are_on_by_default_on_cuda_and_off_with_enforce_eager(tiny_cuda, tok):
    assert EngineCore(tiny_cuda, tok, config(compile_buckets=(2,))).graphs.captured == [2]
    assert EngineCore(tiny_cuda, tok, config(enforce_eager=True)).graphs is None


def test_the_uncaptured_forward_never_syncs(tiny_cuda, tok):
    """The forward a graph captures, run uncaptured under CUDA's sync debug mode "error"."""
    core = EngineCore(tiny_cuda, tok, config(enforce_eager=True))
    max_blocks = -(-min(core.max_model_len, core.pool_tokens) // 16)
    graphs = DecodeGraphs(tiny_cuda, core.cache, [4], max_blocks, compile=False, capture=False)
    graphs.warm_up()
    core.graphs = core.runner.graphs = graphs
    call = graphs._call

    def strict(args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return call(args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    graphs._call = strict
    tokens = generate(core, random_prompts(3, 10, 30, seed=22), staggered(3))
    assert graphs.steps >= 6 and all(tokens)


def test_bfloat16_scout_shaped_decode_replays_eager(tok, monkeypatch):
    """Scout's attention shape (40 query, 8 kv heads, D 128) in bfloat16, 2 layers, shrunk elsewhere:
    the captured step's logits stay within bfloat16 rounding of the eager step's (the two attention
    kernels round differently, which may flip a near-tied expert choice, so experts are not compared)."""
    from locus.engine.checkpoint.presets import PRESETS
    from locus.engine.model.model import Llama4ForCausalLM
    import dataclasses

    cfg = dataclasses.replace(PRESETS["scout-2l"], hidden_size=1024, intermediate_size=512, intermediate_size_mlp=1024,
                              vocab_size=4096, num_local_experts=8)
    torch.manual_seed(0)
    model = Llama4ForCausalLM(cfg, "auto").to("cuda", torch.bfloat16).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0)
    core = EngineCore(model, tok, config(compile_buckets=(4, 8)))
    assert core.graphs.captured == [4, 8]
    checked = check_decode_steps(core, monkeypatch, atol=0.25, same_experts=False)  # bfloat16 logits, O(10)
    generate(core, random_prompts(6, 20, 40, seed=23), staggered(6))
    assert checked


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_a_decode_step_never_syncs_from_schedule_to_its_readback(tiny_cuda, tok, overlap):
    """Item 2 on the device: every launch of a pure decode step (schedule, stage the buffers, replay,
    sample greedy / seeded top-p-k-min-p / penalised / logprob / min_tokens / grammar rows, queue the
    one readback) runs under CUDA's sync debug mode "error"; the tokens equal the serial engine's."""
    pytest.importorskip("xgrammar")
    from tests.engine.core.test_step_pipeline import GUARDED, run_collecting

    kinds = list(GUARDED)
    core = EngineCore(tiny_cuda, tok, config(compile_buckets=(len(kinds),), async_scheduling=overlap))
    real, strict = core.launch, []

    def launch(feed=None):
        scheduler = core.scheduler
        decode = not scheduler.waiting and bool(scheduler.running) and all(s.num_uncomputed == 1 for s in scheduler.running)
        if not decode:
            return real(feed)
        before = core.graphs.steps
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = real(feed)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if launched is not None:  # (None: every sequence's token in flight was its last)
            strict.append(core.graphs.steps > before)
        return launched

    core.launch = launch
    prompts = random_prompts(len(kinds), 5, 12, seed=37)
    for kind, prompt in zip(kinds, prompts):
        core.add_request(kind, prompt, GUARDED[kind])
    finals, _, _ = run_collecting(core)
    assert all(o.error is None for o in finals.values()) and len(strict) >= 3 and all(strict)
    serial = EngineCore(tiny_cuda, tok, config(compile_buckets=(len(kinds),), async_scheduling=False))
    for kind, prompt in zip(kinds, prompts):
        serial.add_request(kind, prompt, GUARDED[kind])
    expected, _, _ = run_collecting(serial)
    assert {k: o.outputs[0].token_ids for k, o in finals.items()} == {k: o.outputs[0].token_ids for k, o in expected.items()}
