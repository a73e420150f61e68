"""Built-in model shapes with seeded random weights (no download needed).

`tiny` is the embedded default model: small enough to run anywhere in a second, yet it has every
Llama-4 feature (chunked RoPE layers, a NoPE layer with temperature tuning, qk-norm, MoE and dense
layers, top-2 routing, GQA). Its weights are random, so its text is gibberish: it exists to exercise
the serving stack, not to answer questions. `small` is the benchmark shape of the engine issue.
`scout-2l` is two layers of Llama-4 Scout's shapes, for measurements on a GPU. `tiny-qwen3-moe` is
`tiny` for the Qwen3-MoE family: softmax top-4 of 16 experts renormalised, per-head q/k norms, a dense
layer among MoE ones (mlp_only_layers), GQA; `locus init-model` writes it as transformers reads it.
`tiny-deepseek-v3` is `tiny` for DeepSeek-V3: latent attention with a q_lora_rank, yarn RoPE, sigmoid
top-4 of 16 experts within 2 of 4 groups (with a score-correction bias), a shared expert, the first layer
dense; `tiny-deepseek-v2-lite` has V2-Lite's form: no q_lora_rank, greedy softmax top-4, two shared
experts.
"""

from __future__ import annotations

import math

import torch

from locus.engine.model.config import ModelConfig, RopeConfig
from locus.engine.model.deepseek_config import V2, V3, DeepseekModelConfig
from locus.engine.model.qwen3_config import Qwen3MoeModelConfig
from locus.engine.model.slices import ExpertSlices, keep_slices, moe_experts
from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.errors import LocusError


def _layers(n: int, nope_interval: int = 4) -> tuple[int, ...]:
    return tuple(int((i + 1) % nope_interval != 0) for i in range(n))


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=ByteTokenizer.MIN_VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, moe_layers=(0, 1, 3), no_rope_layers=_layers(4),
        attention_chunk_size=64, floor_scale=16, attn_scale=0.1, max_position_embeddings=4096,
        rope=RopeConfig(theta=10000.0), bos_token_id=ByteTokenizer.BOS, eos_token_id=(ByteTokenizer.EOS,),
        pad_token_id=ByteTokenizer.PAD, dtype="float32",
    ),
    "small": ModelConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, intermediate_size_mlp=1024,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        num_local_experts=16, num_experts_per_tok=1, moe_layers=(0, 1, 2, 3), no_rope_layers=_layers(4),
        attention_chunk_size=8192, max_position_embeddings=16384, rope=RopeConfig(theta=500000.0),
        bos_token_id=ByteTokenizer.BOS, eos_token_id=(ByteTokenizer.EOS,), pad_token_id=ByteTokenizer.PAD,
        dtype="float32",
    ),
    # Llama-4 Scout's layer shapes (hidden 5120, 16 experts of width 8192, top-1, 40/8 heads, vocabulary
    # 202048) with 2 layers: the "larger synthetic shape" for GPU measurements (~12.7 GB in bfloat16; its
    # random weights are drawn on the host in float32 first, ~25 GB).
    "scout-2l": ModelConfig(
        num_hidden_layers=2, moe_layers=(0, 1), no_rope_layers=_layers(2), bos_token_id=ByteTokenizer.BOS,
        eos_token_id=(ByteTokenizer.EOS,), pad_token_id=ByteTokenizer.PAD, dtype="bfloat16",
    ),
    "tiny-qwen3-moe": Qwen3MoeModelConfig(
        vocab_size=ByteTokenizer.MIN_VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        num_local_experts=16, num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=(2,),
        max_position_embeddings=4096, rope=RopeConfig(theta=10000.0), bos_token_id=ByteTokenizer.BOS,
        eos_token_id=(ByteTokenizer.EOS,), pad_token_id=ByteTokenizer.PAD, dtype="float32",
    ),
    "tiny-deepseek-v3": DeepseekModelConfig(
        model_type=V3, vocab_size=ByteTokenizer.MIN_VOCAB, hidden_size=64, intermediate_size=32,
        intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        rms_norm_eps=1e-6, num_local_experts=16, num_experts_per_tok=4, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1, routed_scaling_factor=2.5,
        topk_method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True, first_k_dense_replace=1,
        max_position_embeddings=4096, rope=RopeConfig(rope_type="yarn", theta=10000.0, factor=4.0,
                                                      original_max_position_embeddings=1024, mscale=1.0,
                                                      mscale_all_dim=1.0),
        bos_token_id=ByteTokenizer.BOS, eos_token_id=(ByteTokenizer.EOS,), pad_token_id=ByteTokenizer.PAD,
        dtype="float32",
    ),
    "tiny-deepseek-v2-lite": DeepseekModelConfig(
        model_type=V2, vocab_size=ByteTokenizer.MIN_VOCAB, hidden_size=64, intermediate_size=32,
        intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        rms_norm_eps=1e-6, num_local_experts=16, num_experts_per_tok=4, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=2, routed_scaling_factor=1.0,
        topk_method="greedy", norm_topk_prob=False, first_k_dense_replace=1, max_position_embeddings=4096,
        rope=RopeConfig(theta=10000.0), bos_token_id=ByteTokenizer.BOS, eos_token_id=(ByteTokenizer.EOS,),
        pad_token_id=ByteTokenizer.PAD, dtype="float32",
    ),
}


def build_preset(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 moe_backend: str = "torch", expert_slices: ExpertSlices | None = None,
                 draw_on_device: bool = False) -> Llama4ForCausalLM:
    """The preset's model with weights drawn from a seeded generator: same seed, same weights, anywhere.
    expert_slices: hold only these experts of each MoE layer (the same values the whole model has).
    draw_on_device: draw the weights on `device`, in `dtype`, with that device's generator (no host
    copy: how a benchmark builds `scout-2l` on a GPU in seconds). Same seed, same weights on the same
    kind of device, but not the host-drawn ones."""
    if name not in PRESETS:
        raise LocusError(f"unknown preset {name!r} (choose {', '.join(PRESETS)}) and no such checkpoint directory")
    config = PRESETS[name]
    with torch.device("meta"):
        model = Llama4ForCausalLM(config, moe_backend)
    if expert_slices is not None:
        keep_slices(model, expert_slices)
    if draw_on_device:
        model.to(dtype=dtype).to_empty(device=device)
        model.tie_weights()
        init_random(model, seed, torch.Generator(device=device))
        return model.eval()
    model.to_empty(device="cpu")
    model.tie_weights()
    init_random(model, seed)
    return model.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def init_random(model: Llama4ForCausalLM, seed: int, gen: torch.Generator | None = None) -> None:
    """Fan-in scaled normal weights (std = 1/sqrt(fan_in)), unit norms; drawn in a fixed order by `gen`
    (default: a CPU generator, in float32), on the generator's device.
    A sliced expert tensor draws its whole [E, ...] tensor (one at a time) and keeps its rows, so the
    generator's sequence, and every weight, is the whole model's."""
    gen = (gen or torch.Generator()).manual_seed(seed)
    draw = {"generator": gen, "device": gen.device}
    experts = {f"model.layers.{layer}.feed_forward.experts": module for layer, module in moe_experts(model).items()}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if "embed_tokens" in name:
            fan_in = 1  # embeddings are looked up, not multiplied: unit scale keeps the residual stream O(1)
        elif param.dim() == 3:
            fan_in = param.shape[1]  # [E, in, out]
        else:
            fan_in = param.shape[-1]  # nn.Linear [out, in]
        dtype = torch.float32 if gen.device.type == "cpu" else param.dtype
        owner = experts.get(name.rsplit(".", 1)[0])
        if owner is not None and owner.expert_ids is not None:
            full = torch.randn((model.config.num_local_experts, *param.shape[1:]), dtype=dtype, **draw)
            param.copy_(full[owner.expert_ids] / math.sqrt(fan_in))
            continue
        param.copy_(torch.randn(param.shape, dtype=dtype, **draw).div_(math.sqrt(fan_in)))
