"""DeepSeek on the compiled decode path (decode_graph.py): latent attention reading the paged latent
cache, yarn's rotation length and the group-limited routers under torch.compile (where rotations are
real cos/sin pairs) give the eager engine's tokens."""

from __future__ import annotations

import pytest

from locus.engine.checkpoint.loader import load
from locus.engine.core.engine_core import EngineConfig
from locus.engine.frontend.llm import LLM
from locus.engine.model.generate import generate_tokens
from locus.engine.sampling.sampler import SamplingParams


@pytest.mark.slow  # compiles two decode graphs
@pytest.mark.parametrize("preset", ["tiny-deepseek-v3"])
def test_compiled_decode_gives_the_eager_tokens(preset):
    loaded = load(preset, device="cpu", moe_backend="torch")
    prompts = [[1, 72, 101, 108, 108, 111] * k for k in (1, 2, 3)]
    llm = LLM.from_model(loaded.model, loaded.tokenizer,
                         EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4, compile_decode=True,
                                      compile_buckets=(1, 4)))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert llm.engine.graphs.steps == 9  # every decode step ran compiled (the first token comes from prefill)
    assert [o.outputs[0].token_ids for o in outs] == [generate_tokens(loaded.model, p, 10) for p in prompts]
