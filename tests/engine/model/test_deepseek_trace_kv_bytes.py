"""A recorded trace's `kv_bytes_per_token` is what the engine's paged KV cache really holds per token:
for DeepSeek's latent attention the latent and the rotated key of every layer (not the GQA formula's
K and V heads), for Qwen3-MoE and Llama-4 their K and V heads (docs/models.md, "KV cache bytes per
token"). The cache's bytes are read off its tensors, not recomputed from a formula."""

from __future__ import annotations

import pytest
import torch

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.sampling.sampler import SamplingParams
from locus.traces.reader import TraceReader


def cache_bytes_per_token(core: EngineCore) -> int:
    """Bytes of every cache tensor (all layers, both halves) over the positions the pool holds."""
    cache = core.cache
    tensors = [*cache.keys, *cache.values]
    positions = cache.keys[0].shape[0]
    assert all(t.shape[0] == positions for t in tensors)  # one row group per pool position in each
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert total % positions == 0
    return total // positions


def record(preset: str, dtype: torch.dtype, path) -> tuple[int, int]:
    """(the trace's kv_bytes_per_token, the cache's bytes per token) of a short recorded run."""
    core = EngineCore(build_preset(preset, seed=0, dtype=dtype), ByteTokenizer(PRESETS[preset].vocab_size),
                      EngineConfig(block_size=8, num_kv_blocks=16))
    core.start_recording(path, preset)
    core.add_request("r", list(range(3, 14)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while core.has_unfinished():
        core.step()
    core.dump_recording()
    return TraceReader(path).meta.kv_bytes_per_token, cache_bytes_per_token(core)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_deepseek_v3_trace_states_the_latent_cache_bytes(tmp_path, dtype):
    recorded, held = record("tiny-deepseek-v3", dtype, tmp_path / "trace")
    assert recorded == held
    c = PRESETS["tiny-deepseek-v3"]
    item = torch.empty((), dtype=dtype).element_size()
    # 4 layers x (latent 16 + rotated key 8) x dtype bytes: 384 B in float32, as docs/models.md states
    assert held == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * item
    # the GQA formula (2 x layers x heads x head_dim) the trace used to state for every family differs
    assert held != 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * item


@pytest.mark.parametrize("preset", ["tiny-deepseek-v2-lite", "tiny-qwen3-moe", "tiny"])
def test_other_families_traces_state_their_cache_bytes(tmp_path, preset):
    recorded, held = record(preset, torch.float32, tmp_path / "trace")
    assert recorded == held
    c = PRESETS[preset]
    if preset.startswith("tiny-deepseek"):
        assert held == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    else:  # GQA: a key and a value per KV head per layer
        assert held == 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
