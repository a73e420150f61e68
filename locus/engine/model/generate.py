"""Greedy single-sequence generation with a contiguous KV cache: prefill once, then one token per step.

The reference the engine is checked against: "running each prompt alone through the model" (tests
of parity with transformers, of the continuous-batching engine, and of the MoE backends). Serving
and `locus generate` use the engine (`LLM`), whose Sampler handles every sampling parameter.
"""

from __future__ import annotations

import torch

from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.kv_cache import ContiguousKVCache
from locus.engine.model.model import Llama4ForCausalLM


@torch.inference_mode()
def generate_tokens(model: Llama4ForCausalLM, prompt_ids: list[int], max_tokens: int,
                    stop_ids: tuple[int, ...] = ()) -> list[int]:
    """New greedy token ids (stops after a stop id, which is included, or after max_tokens)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {limit}")
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + max_tokens, model.dtype, model.device)
    batch = ForwardBatch.single(prompt_ids, device=model.device)
    out: list[int] = []
    while True:
        hidden = model(batch, cache).hidden
        token = int(torch.argmax(model.compute_logits(hidden[-1:])[0]))
        out.append(token)
        if token in stop_ids or len(out) == max_tokens:
            return out
        batch = ForwardBatch.single([token], start=len(prompt_ids) + len(out) - 1, device=model.device)
