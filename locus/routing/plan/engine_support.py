"""Whether another engine applies an exported plan to a model family, as that engine's own source shows.

A plan names its model by a free string (a preset, a checkpoint directory, a served name); the family is
read from it. Each verdict below was checked in the released package's source (SGLang 0.5.23, vLLM
0.33.0; docs/interop.md has the table and the file each fact comes from):
    SGLang places experts only for model classes with `get_model_config_for_expert_location`;
    for the others `ModelConfigForExpertLocation.from_model_config` returns None, so
    `compute_initial_expert_location_metadata` returns None, and their MoE layers are sized without
    `--ep-num-redundant-experts`. Llama-4 (llama4.py, mllama4.py) and Mixtral (mixtral.py) are such
    classes; DeepSeek-V2/V3 (deepseek_v2.py) and Qwen3-MoE (qwen3_moe.py) are not.
    vLLM runs EPLB for every model class implementing `MixtureOfExperts`: Llama-4, Mixtral, DeepSeek-V2/V3
    and Qwen3-MoE all do, so no family is refused there (loading the plan takes a patch either way).
Families not listed get no verdict, only a note to check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # as a user would write it
    pattern: str  # searched for, case-insensitively, in the plan's model name
    unplaced: dict[str, str]  # engine -> the model classes that ignore expert placement there


# Locus serves Llama-4 only: a plan recorded on one of its own presets is for a Llama-4-shaped model.
LOCUS_PRESETS = ("tiny", "small", "scout-2l")

FAMILIES = (
    Family("Llama-4", r"llama[-_ ]?4|^(" + "|".join(map(re.escape, LOCUS_PRESETS)) + r")$",
           {"sglang": "Llama4ForCausalLM (llama4.py) and Llama4ForConditionalGeneration (mllama4.py)"}),
    Family("Mixtral", r"mixtral", {"sglang": "MixtralForCausalLM (mixtral.py)"}),
    Family("DeepSeek-V2/V3", r"deepseek", {}),
    Family("Qwen3-MoE", r"qwen[-_ ]?3", {}),
)
ENGINE_NAMES = {"sglang": "SGLang 0.5.23", "vllm": "vLLM 0.33.0"}


def model_family(model: str) -> Family | None:
    """The family `model` (a plan's model name) belongs to, or None when the name says nothing known."""
    tail = model.strip().rstrip("/").split("/")[-1]
    return next((f for f in FAMILIES if re.search(f.pattern, tail, re.IGNORECASE)), None)


def placement_warning(model: str, engine: str) -> str | None:
    """One line for stderr when `engine` will not apply a plan for `model`; a note when the family is unknown."""
    family = model_family(model)
    where = ENGINE_NAMES.get(engine)
    if where is None:
        return None
    if family is None:
        return (f"note: model {model!r} is of no family Locus has checked {where} for; check that {where} places "
                "experts for its model class (docs/interop.md, \"What each engine honours\")")
    classes = family.unplaced.get(engine)
    if classes is None:
        return None
    return (f"warning: {where} does not place experts for {family.name} models (model {model!r}): {classes} have "
            "no expert-location support, so this plan and --ep-num-redundant-experts will not be applied there "
            "(docs/interop.md, \"What each engine honours\")")
