"""Named synthetic-trace presets: real model shapes, routing knobs calibrated to published figures.

Shapes are the public checkpoints' (MoE layers as their configs define them). The routing knobs are
tuned so that `locus trace stats` on a preset trace lands in the ranges docs/design.md, "What real routing
looks like" quotes; docs/traces.md lists what each preset measures and the command that measured it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from locus.traces.synth import SynthConfig

PRESETS: dict[str, SynthConfig] = {
    # Llama-4 Scout: 48 layers, every one MoE (interleave step 1), 16 experts, top-1.
    "llama4-scout": SynthConfig(
        model="llama4-scout", num_experts=16, top_k=1, moe_layers=tuple(range(48)), hidden_size=5120,
        zipf_exponent=0.45, layer_skew_spread=0.12, decode_zipf_scale=0.85, domain_skew=1.0,
        request_spread=0.8, prefill_decode_corr=0.8, layer_affinity=0.25,
    ),
    # Llama-4 Maverick: 48 layers, MoE on odd layers (interleave step 2), 128 experts, top-1.
    "llama4-maverick": SynthConfig(
        model="llama4-maverick", num_experts=128, top_k=1, moe_layers=tuple(range(1, 48, 2)), hidden_size=5120,
        zipf_exponent=0.6, layer_skew_spread=0.12, decode_zipf_scale=0.88, domain_skew=0.85,
        request_spread=0.8, prefill_decode_corr=0.8, layer_affinity=0.25,
    ),
    # DeepSeek-V3: 61 layers, the first 3 dense, 256 routed experts, top-8.
    "deepseek-v3": SynthConfig(
        model="deepseek-v3", num_experts=256, top_k=8, moe_layers=tuple(range(3, 61)), hidden_size=7168,
        zipf_exponent=0.5, layer_skew_spread=0.12, decode_zipf_scale=0.88, domain_skew=0.85,
        request_spread=0.8, prefill_decode_corr=0.8, layer_affinity=0.2,
    ),
    # Qwen3-235B-A22B: 94 layers, all MoE, 128 experts, top-8.
    "qwen3-235b": SynthConfig(
        model="qwen3-235b", num_experts=128, top_k=8, moe_layers=tuple(range(94)), hidden_size=4096,
        zipf_exponent=0.15, layer_skew_spread=0.12, decode_zipf_scale=0.85, domain_skew=0.8,
        request_spread=0.8, prefill_decode_corr=0.8, layer_affinity=0.2,
    ),
    # Mixtral-8x7B: 32 layers, 8 experts, top-2; nearly uniform, almost no domain specificity.
    "mixtral-8x7b": SynthConfig(
        model="mixtral-8x7b", num_experts=8, top_k=2, moe_layers=tuple(range(32)), hidden_size=4096,
        zipf_exponent=0.1, layer_skew_spread=0.2, domain_skew=0.05, request_spread=0.2,
        prefill_decode_corr=0.5, layer_affinity=0.05,
    ),
}


def preset_config(name: str, **overrides: Any) -> SynthConfig:
    """The named preset with some fields replaced (requests=..., seed=..., any knob)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
    return dataclasses.replace(base, **overrides)


def find_preset(model: str) -> SynthConfig | None:
    """The preset whose name matches `model` (case-insensitive), for filling in model shapes."""
    return PRESETS.get(model.lower())
