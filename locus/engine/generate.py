"""Single-sequence generation with a KV cache: prefill the prompt once, then one token per step.

This is the foundation's generation loop (used by `locus generate` and the parity tests); the
continuous-batching engine reuses the same model forward with many sequences per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from locus.engine.forward_batch import ForwardBatch
from locus.engine.kv_cache import ContiguousKVCache
from locus.engine.model import Llama4ForCausalLM


@dataclass(frozen=True)
class SimpleSampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sample_next(logits: torch.Tensor, params: SimpleSampling, gen: torch.Generator | None) -> int:
    """logits [vocab] float32 -> token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@torch.inference_mode()
def generate_tokens(model: Llama4ForCausalLM, prompt_ids: list[int], max_tokens: int,
                    sampling: SimpleSampling = SimpleSampling(), stop_ids: tuple[int, ...] = ()) -> list[int]:
    """New token ids (stops after a stop id, which is included, or after max_tokens)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + max_tokens > limit:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's context of {limit}")
    gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
    cache = ContiguousKVCache(model.config, 1, len(prompt_ids) + max_tokens, model.dtype, model.device)
    batch = ForwardBatch.single(prompt_ids, device=model.device)
    out: list[int] = []
    while True:
        hidden = model(batch, cache).hidden
        token = sample_next(model.compute_logits(hidden[-1:])[0], sampling, gen)
        out.append(token)
        if token in stop_ids or len(out) == max_tokens:
            return out
        batch = ForwardBatch.single([token], start=len(prompt_ids) + len(out) - 1, device=model.device)
