"""The model config's fields: `ModelConfig` (Llama-4's, the base of every family's) and `RopeConfig`,
with the RoPE reader the families share. config.py reads config.json into them; a family's subclass
(qwen3_config.py) adds its own fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from locus.errors import LocusError

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 500000.0
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn (DeepSeek): the band of dims between beta_slow and beta_fast rotations
    beta_slow: float = 1.0  # is interpolated between the original and the stretched frequencies
    # yarn: the rotation's length is get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) when
    # both are set (else get_mscale(factor)); mscale_all_dim also corrects the softmax scale (deepseek.py).
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn: the rotation's length, given outright


@dataclass(frozen=True)
class ModelConfig:
    # The model family, which picks the attention, router and checkpoint naming variants
    # (locus/engine/model/families.py); a subclass per other family (qwen3_config.py).
    family: ClassVar[str] = "llama4"
    rope_types: ClassVar[tuple[str, ...]] = ROPE_TYPES  # the RoPE rules the family implements
    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192  # expert and shared-expert width
    intermediate_size_mlp: int = 16384  # dense-layer width
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    moe_layers: tuple[int, ...] = ()
    no_rope_layers: tuple[int, ...] = ()  # 1 = the layer uses RoPE, 0 = NoPE
    attention_chunk_size: int | None = 8192
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192
    attn_scale: float = 0.1
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype, if config.json says

    def __post_init__(self) -> None:
        problems = []
        L = self.num_hidden_layers
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            problems.append(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_local_experts ({self.num_local_experts})")
        if len(self.no_rope_layers) != L:
            problems.append(f"no_rope_layers has {len(self.no_rope_layers)} entries for {L} layers")
        if any(not 0 <= i < L for i in self.moe_layers):
            problems.append(f"moe_layers {list(self.moe_layers)} names a layer outside 0..{L - 1}")
        if self.attention_chunk_size is not None and self.attention_chunk_size <= 0:
            problems.append(f"attention_chunk_size must be positive, got {self.attention_chunk_size}")
        if self.rope.rope_type not in self.rope_types:
            problems.append(f"unknown rope_type {self.rope.rope_type!r} (supported: {', '.join(self.rope_types)})")
        if problems:
            raise LocusError("invalid model config: " + "; ".join(problems))

    # The per-layer rules of docs/design.md ("The model"), in one place.
    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def uses_rope(self, layer: int) -> bool:
        return bool(self.no_rope_layers[layer])

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(rows, width) per token and layer of the KV cache's two tensors: keys and values, one row per KV
        head (a family with another cache layout overrides this: deepseek_config.py)."""
        return (self.num_key_value_heads, self.head_dim), (self.num_key_value_heads, self.head_dim)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_id

    def to_hf_dict(self) -> dict[str, Any]:
        """A `Llama4TextConfig`-style dict (what save_checkpoint writes as config.json)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("rope", "dtype")}
        d["moe_layers"] = list(self.moe_layers)
        d["no_rope_layers"] = list(self.no_rope_layers)
        d["eos_token_id"] = list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0]
        d["interleave_moe_layer_step"] = 1  # moe_layers is explicit; this only keeps old readers happy
        rope = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type in ("linear", "llama3"):
            rope["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope.update(
                low_freq_factor=self.rope.low_freq_factor,
                high_freq_factor=self.rope.high_freq_factor,
                original_max_position_embeddings=self.rope.original_max_position_embeddings,
            )
        d["rope_parameters"] = rope
        d.update(model_type="llama4_text", architectures=["Llama4ForCausalLM"], hidden_act="silu")
        if self.dtype:
            d["torch_dtype"] = self.dtype
        return d


def parse_rope(d: dict[str, Any], where: str, allowed: tuple[str, ...] = ROPE_TYPES) -> RopeConfig:
    params = d.get("rope_parameters")
    if params is None:
        params = dict(d.get("rope_scaling") or {})
        params.setdefault("rope_theta", d.get("rope_theta", RopeConfig.theta))
    if not isinstance(params, dict):
        raise LocusError(f"{where}: rope_parameters must be an object, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in allowed:
        raise LocusError(f"{where}: unknown rope_type {rope_type!r} (supported: {', '.join(allowed)})")
    kwargs: dict[str, Any] = {"rope_type": rope_type, "theta": float(params.get("rope_theta", d.get("rope_theta", RopeConfig.theta)))}
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "yarn": ("factor",)}.get(rope_type, ())
    for key in needed:
        if key not in params:
            raise LocusError(f"{where}: rope_type {rope_type!r} needs {key!r}")
        kwargs[key] = float(params[key])
    if rope_type in ("llama3", "yarn"):
        kwargs["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        )
    if rope_type == "yarn":
        if params.get("truncate", True) is not True:
            raise LocusError(f"{where}: rope_parameters truncate {params['truncate']!r} is not supported (yarn's band is truncated)")
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                kwargs[key] = float(params[key])
    return RopeConfig(**kwargs)


def as_int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
