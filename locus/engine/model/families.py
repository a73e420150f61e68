"""The model families Locus serves, and the modules each one's config selects.

A family is picked by its config's class (`ModelConfig.family`); the decoder layer asks this table for
its attention and MoE block instead of testing the family itself. Dense layers are the same SwiGLU MLP
in every family.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from locus.engine.model.attention import Attention
from locus.engine.model.config import ModelConfig
from locus.engine.model.deepseek import DeepseekAttention, DeepseekMoEBlock
from locus.engine.model.moe import MoEBlock
from locus.engine.model.qwen3 import Qwen3Attention, Qwen3MoEBlock


@dataclass(frozen=True)
class Family:
    label: str  # how errors and logs name the model
    attention: type[nn.Module]
    moe_block: type[nn.Module]


FAMILIES: dict[str, Family] = {
    "llama4": Family("Llama-4 text", Attention, MoEBlock),
    "qwen3_moe": Family("Qwen3-MoE", Qwen3Attention, Qwen3MoEBlock),
    "deepseek": Family("DeepSeek", DeepseekAttention, DeepseekMoEBlock),
}


def family_of(config: ModelConfig) -> Family:
    return FAMILIES[config.family]
