"""A DeepSeek-V3 request moved to another engine after its prefill (what `--ep-moves` does on each side:
locus/engine/core/migration.py) carries its latent cache rows, each position's latent then its rotated
key, and goes on exactly as if it had stayed; what it sends per position is the trace's
`kv_bytes_per_token` (the cache's bytes, not the GQA formula's). Qwen3-MoE's GQA cache moves as
Llama-4's (tests/engine/core/test_migration.py)."""

from __future__ import annotations

import pickle

import pytest

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.core.engine_core import EngineCore
from locus.engine.core.migration import kv_bytes_per_token, take_in, take_out
from locus.traces.reader import TraceReader
from tests.engine.core.test_migration import CASES, config, run_to_end, same_output, step


@pytest.mark.parametrize("preset", ["tiny-deepseek-v3", "tiny-deepseek-v2-lite", "tiny-qwen3-moe"])
@pytest.mark.parametrize("steps_before", [1, 3])
def test_a_moved_request_of_the_new_families_generates_what_it_would_have(tmp_path, preset, steps_before):
    model, tok = build_preset(preset, seed=0), ByteTokenizer(PRESETS[preset].vocab_size)
    prompts = {name: list(range(30 + i, 47 + 3 * i)) for i, name in enumerate(CASES)}
    want: dict = {}
    alone = EngineCore(model, tok, config())
    for name, params in CASES.items():
        alone.add_request(name, prompts[name], params)
    run_to_end(alone, want)

    source, target = EngineCore(model, tok, config()), EngineCore(model, tok, config())
    target.add_request("other", list(range(5, 25)), CASES["greedy"])  # the target is busy with its own
    source.start_recording(tmp_path / "trace", preset)
    got: dict = {}
    for name, params in CASES.items():
        source.add_request(name, prompts[name], params)
    for _ in range(steps_before):  # the prefill, then decode steps, on the source
        step(source, got)
    source.dump_recording()  # (before the moves: a moved request's rows go with it)
    recorded = TraceReader(tmp_path / "trace").meta.kv_bytes_per_token
    c = PRESETS[preset]
    per_layer = c.kv_lora_rank + c.qk_rope_head_dim if preset.startswith("tiny-deepseek") \
        else 2 * c.num_key_value_heads * c.head_dim
    assert kv_bytes_per_token(source) == recorded == c.num_hidden_layers * per_layer * 4
    for name in CASES:
        migrant = take_out(source, name)
        assert migrant.kv_tokens == len(prompts[name]) + steps_before - 1  # every computed position
        assert migrant.kv.numel() * migrant.kv.element_size() == migrant.kv_tokens * recorded
        wire = pickle.loads(pickle.dumps(migrant.state()))  # what travels besides the rows
        wire.kv = migrant.kv.clone()
        assert take_in(target, wire)
    run_to_end(target, got)
    for name in CASES:
        assert same_output(got[name], want[name]), (name, got[name], want[name])
    assert target.blocks.num_free_blocks == target.blocks.num_blocks
