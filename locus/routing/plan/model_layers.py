"""Which model layers are MoE layers, for a model named on the command line: a checkpoint directory's
config.json, or one of the trace presets' real model shapes (locus/traces/presets.py).

Other engines' expert maps do not say it (vLLM's and DeepSeek EPLB's rows are the MoE layers only,
SGLang's are every model layer), so `locus plan import` asks for it instead of guessing 0..L-1.
routing/ may not import the engine (docs/design.md, "Layout and layering"), so the config.json rules are
restated here as transformers and the engine's config_from_hf_dict read them (tests check they agree):
Llama-4's, an explicit `moe_layers` list, else every `interleave_moe_layer_step`-th layer; Qwen3-MoE's
(`model_type: qwen3_moe`), every layer i not in `mlp_only_layers` with (i + 1) a multiple of
`decoder_sparse_step`; DeepSeek-V3 / V2's (`deepseek_v3`, `deepseek_v2`), every layer i >=
`first_k_dense_replace` (default 3 for V3, 0 for V2) with i a multiple of `moe_layer_freq` (default 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from locus.errors import LocusError
from locus.files import read_json
from locus.traces.presets import find_preset

LLAMA4_TYPES = (None, "llama4", "llama4_text")
QWEN3_MOE = "qwen3_moe"
DEEPSEEK_FIRST_DENSE = {"deepseek_v3": 3, "deepseek_v2": 0}  # transformers' first_k_dense_replace defaults


def model_moe_layers(model: str) -> tuple[int, ...] | None:
    """The MoE layers of `model` (a directory with a config.json, or a trace preset's name); None when
    it is neither, so the caller can ask for --moe-layers."""
    path = Path(model)
    if path.is_dir():
        return config_moe_layers(path / "config.json")
    preset = find_preset(model)
    return None if preset is None else tuple(preset.moe_layers)


def config_moe_layers(path: Path) -> tuple[int, ...]:
    """The MoE layers a Llama-4 config.json (text or multimodal) or a Qwen3-MoE one states."""
    if not path.is_file():
        raise LocusError(f"{path}: missing config.json (not a HuggingFace checkpoint directory?)")
    raw = read_json(path, "model config")
    text = _text_config(raw, path)
    try:
        layers = int(text["num_hidden_layers"])
        explicit = text.get("moe_layers")
        if raw.get("model_type") == QWEN3_MOE:
            step = int(text.get("decoder_sparse_step") or 1)
            if step < 1:
                raise LocusError(f"{path}: decoder_sparse_step must be >= 1, got {step}")
            dense = {int(i) for i in text.get("mlp_only_layers") or ()}
            moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        elif raw.get("model_type") in DEEPSEEK_FIRST_DENSE:
            first = text.get("first_k_dense_replace")
            first = DEEPSEEK_FIRST_DENSE[raw["model_type"]] if first is None else int(first)
            freq = int(text.get("moe_layer_freq") or 1)
            if freq < 1:
                raise LocusError(f"{path}: moe_layer_freq must be >= 1, got {freq}")
            moe = tuple(i for i in range(layers) if i >= first and i % freq == 0)
        elif explicit is not None:
            moe = tuple(int(i) for i in explicit)
        else:
            step = int(text.get("interleave_moe_layer_step", 1))
            if step < 1:
                raise LocusError(f"{path}: interleave_moe_layer_step must be >= 1, got {step}")
            moe = tuple(range(step - 1, layers, step))
    except KeyError:
        raise LocusError(f"{path}: no num_hidden_layers: cannot tell the MoE layers; pass --moe-layers") from None
    except (TypeError, ValueError):
        raise LocusError(f"{path}: num_hidden_layers, moe_layers, interleave_moe_layer_step, decoder_sparse_step, "
                         "mlp_only_layers, first_k_dense_replace or moe_layer_freq is not an integer (list)") from None
    if not moe or any(not 0 <= i < layers for i in moe):
        raise LocusError(f"{path}: moe_layers {list(moe)} names no layer, or one outside 0..{layers - 1}")
    return moe


def _text_config(raw: Any, path: Path) -> dict:
    """The dict holding the text model's fields (a multimodal Llama-4 config nests it in text_config)."""
    if not isinstance(raw, dict):
        raise LocusError(f"{path}: expected a JSON object")
    if raw.get("model_type") == QWEN3_MOE or raw.get("model_type") in DEEPSEEK_FIRST_DENSE:
        return raw
    text = raw.get("text_config", raw)
    if not isinstance(text, dict):
        raise LocusError(f"{path}: text_config must be an object")
    for model_type in (raw.get("model_type"), text.get("model_type")):
        if model_type not in LLAMA4_TYPES:
            raise LocusError(f"{path}: model_type {model_type!r} is not a Llama-4 model, qwen3_moe, deepseek_v3 or "
                             "deepseek_v2, whose MoE layers Locus reads; pass --moe-layers")
    return text
