"""Checkpoint tensor names per model family, to and from the model's own parameter names.

Locus's modules carry Llama-4's checkpoint names in every family (`feed_forward.router`,
`feed_forward.experts`), so the engine finds a layer's MoE block one way. A Qwen3-MoE checkpoint names
them as transformers' Qwen3MoeForCausalLM saves them and the published checkpoints hold them:
    model.layers.i.mlp.gate.weight                        -> model.layers.i.feed_forward.router.weight
    model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight -> ...feed_forward.experts.j.{...}.weight
    model.layers.i.mlp.{gate,up,down}_proj.weight (dense) -> ...feed_forward.{...}.weight
Attention (q/k/v/o, q_norm, k_norm), norms, embeddings and lm_head keep their names.

A DeepSeek-V3 / V2 checkpoint names the same `mlp.` modules, and two more:
    model.layers.i.mlp.gate.e_score_correction_bias (V3)  -> ...feed_forward.e_score_correction_bias
    model.layers.i.mlp.shared_experts.{gate,up,down}_proj -> ...feed_forward.shared_expert.{...}
Its attention (q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj) keeps its names. DeepSeek-V3's published checkpoints also hold its multi-token-
prediction layers as `model.layers.{i}` with i >= num_hidden_layers; Locus (as transformers) does not
build them, and to_model_name gives None for their tensors: the loader skips them.
"""

from __future__ import annotations

import re

from locus.engine.model.config import ModelConfig
from locus.errors import LocusError

_QWEN3_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")
_QWEN3_MLP = re.compile(r"^(model\.layers\.\d+)\.mlp\.(.+)$")
_QWEN3_FUSED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")
_DEEPSEEK_BIAS = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.e_score_correction_bias$")
_DEEPSEEK_SHARED = re.compile(r"^(model\.layers\.\d+)\.mlp\.shared_experts\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_LOCUS_ROUTER = re.compile(r"^(model\.layers\.\d+)\.feed_forward\.router\.weight$")
_LOCUS_BIAS = re.compile(r"^(model\.layers\.\d+)\.feed_forward\.e_score_correction_bias$")
_LOCUS_SHARED = re.compile(r"^(model\.layers\.\d+)\.feed_forward\.shared_expert\.(.+)$")
# The families whose checkpoints use transformers' `mlp.` names (Llama-4's carry Locus's own).
MLP_NAMED = ("qwen3_moe", "deepseek")
_LOCUS_FFN = re.compile(r"^(model\.layers\.\d+)\.feed_forward\.(.+)$")


def to_model_name(config: ModelConfig, name: str) -> str | None:
    """The model's parameter name for checkpoint tensor `name` (prefix already stripped); None for a
    tensor of a layer the family does not build (DeepSeek's multi-token-prediction layers)."""
    if config.family not in MLP_NAMED:
        return name
    if _QWEN3_FUSED.match(name):
        label = "Qwen3-MoE" if config.family == "qwen3_moe" else "DeepSeek"
        raise LocusError(f"tensor {name!r}: Locus reads {label} experts one by one "
                         "(mlp.experts.J.gate_proj.weight, ...), as save_pretrained and the published checkpoints write them")
    if config.family == "deepseek":
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            return None
        match = _DEEPSEEK_BIAS.match(name)
        if match:
            return f"{match.group(1)}.feed_forward.e_score_correction_bias"
        match = _DEEPSEEK_SHARED.match(name)
        if match:
            return f"{match.group(1)}.feed_forward.shared_expert.{match.group(2)}"
    match = _QWEN3_ROUTER.match(name)
    if match:
        return f"{match.group(1)}.feed_forward.router.weight"
    match = _QWEN3_MLP.match(name)
    return f"{match.group(1)}.feed_forward.{match.group(2)}" if match else name


def to_checkpoint_name(config: ModelConfig, name: str) -> str:
    """The checkpoint name save_checkpoint writes for the model's parameter (or per-expert) `name`."""
    if config.family not in MLP_NAMED:
        return name
    if config.family == "deepseek":
        match = _LOCUS_BIAS.match(name)
        if match:
            return f"{match.group(1)}.mlp.gate.e_score_correction_bias"
        match = _LOCUS_SHARED.match(name)
        if match:
            return f"{match.group(1)}.mlp.shared_experts.{match.group(2)}"
    match = _LOCUS_ROUTER.match(name)
    if match:
        return f"{match.group(1)}.mlp.gate.weight"
    match = _LOCUS_FFN.match(name)
    return f"{match.group(1)}.mlp.{match.group(2)}" if match else name


def experts_per_expert(config: ModelConfig) -> bool:
    """Whether this family's checkpoints must hold experts one by one (transformers reads Qwen3-MoE's and
    DeepSeek's so)."""
    return config.family in MLP_NAMED
