"""Model configuration: Llama-4 text fields, parsed from a HuggingFace config.json.

A `qwen3_moe` config.json becomes the Qwen3-MoE subclass (qwen3_config.py), a `deepseek_v3` or
`deepseek_v2` one the DeepSeek subclass (deepseek_config.py); any other model_type is refused in one line.

A config.json may be a `Llama4TextConfig` (model_type "llama4_text") or a full `Llama4Config`
(model_type "llama4") whose `text_config` holds the text fields. RoPE comes either as `rope_theta` +
`rope_scaling` (older files) or as `rope_parameters` (newer ones); both become one `RopeConfig`.
Defaults are those of transformers' `Llama4TextConfig`, so a sparse config.json means the same here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The fields live in config_base.py (a family's subclass imports them without importing this reader).
from locus.engine.model.config_base import ROPE_TYPES, ModelConfig, RopeConfig, as_int_tuple, parse_rope
from locus.engine.model.deepseek_config import MODEL_TYPES as DEEPSEEK_MODEL_TYPES
from locus.engine.model.deepseek_config import parse_deepseek
from locus.engine.model.qwen3_config import parse_qwen3_moe
from locus.errors import LocusError

__all__ = ["ROPE_TYPES", "ModelConfig", "RopeConfig", "as_int_tuple", "config_from_hf_dict", "load_config",
           "parse_rope"]

SUPPORTED_MODEL_TYPES = ("llama4", "llama4_text", "qwen3_moe", *DEEPSEEK_MODEL_TYPES)


def config_from_hf_dict(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Parse a Llama4TextConfig, Llama4Config, Qwen3MoeConfig or DeepseekV3Config / DeepseekV2Config dict;
    errors name `where`."""
    if not isinstance(raw, dict):
        raise LocusError(f"{where}: expected a JSON object")
    d = raw
    model_type = raw.get("model_type")
    if model_type == "qwen3_moe":
        return parse_qwen3_moe(raw, where)
    if model_type in DEEPSEEK_MODEL_TYPES:
        return parse_deepseek(raw, where)
    if "text_config" in raw:
        d = raw["text_config"]
        if not isinstance(d, dict):
            raise LocusError(f"{where}: text_config must be an object")
    elif model_type in ("llama4_vision_model",) or ("vision_config" in raw and model_type != "llama4_text"):
        raise LocusError(f"{where}: this is a vision-only config (model_type {model_type!r}); Locus serves the text model and needs a text_config")
    elif model_type not in (None, "llama4_text", "llama4"):
        raise LocusError(f"{where}: model_type {model_type!r} is not a Llama-4 text model "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")

    defaults = ModelConfig.__dataclass_fields__
    def get(name: str) -> Any:
        if name in d and d[name] is not None:
            return d[name]
        default = defaults[name].default
        return default

    L = int(get("num_hidden_layers"))
    moe_layers = d.get("moe_layers")
    if moe_layers is None:
        step = int(d.get("interleave_moe_layer_step", 1))
        if step < 1:
            raise LocusError(f"{where}: interleave_moe_layer_step must be >= 1, got {step}")
        moe_layers = range(step - 1, L, step)
    no_rope = d.get("no_rope_layers")
    if not no_rope:  # transformers treats an empty list like a missing one
        interval = int(d.get("no_rope_layer_interval", 4))
        no_rope = [int((i + 1) % interval != 0) for i in range(L)]
    heads = int(get("num_attention_heads"))
    head_dim = d.get("head_dim") or int(get("hidden_size")) // heads
    eos = d.get("eos_token_id", raw.get("eos_token_id", 2))
    try:
        return ModelConfig(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("intermediate_size")),
            intermediate_size_mlp=int(get("intermediate_size_mlp")),
            num_hidden_layers=L,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("rms_norm_eps")),
            num_local_experts=int(get("num_local_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok")),
            moe_layers=tuple(int(i) for i in moe_layers),
            no_rope_layers=tuple(int(v) for v in no_rope),
            attention_chunk_size=d.get("attention_chunk_size", defaults["attention_chunk_size"].default),
            use_qk_norm=bool(get("use_qk_norm")),
            attn_temperature_tuning=bool(get("attn_temperature_tuning")),
            floor_scale=float(get("floor_scale")),
            attn_scale=float(get("attn_scale")),
            attention_bias=bool(get("attention_bias")),
            max_position_embeddings=int(get("max_position_embeddings")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
            rope=parse_rope(d, where),
            bos_token_id=d.get("bos_token_id", raw.get("bos_token_id", 1)),
            eos_token_id=as_int_tuple(eos),
            pad_token_id=d.get("pad_token_id"),
            dtype=d.get("torch_dtype") or d.get("dtype") or raw.get("torch_dtype") or raw.get("dtype"),
        )
    except (TypeError, ValueError) as exc:
        raise LocusError(f"{where}: {exc}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise LocusError(f"{path}: missing config.json (not a HuggingFace checkpoint directory?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LocusError(f"{path}: not valid JSON ({exc})") from None
    return config_from_hf_dict(raw, str(path))
