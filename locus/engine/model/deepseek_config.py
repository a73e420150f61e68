"""DeepSeek-V3 and DeepSeek-V2 model configuration (`model_type: deepseek_v3` / `deepseek_v2`,
transformers' DeepseekV3Config / DeepseekV2Config).

The family shares Locus's `ModelConfig` fields where they mean the same thing, so the engine (slices,
expert parallelism, trace recorder) reads one shape:
    moe_intermediate_size -> intermediate_size (the routed experts' width)
    intermediate_size     -> intermediate_size_mlp (the dense layers' width)
    n_routed_experts      -> num_local_experts
    qk_rope_head_dim      -> head_dim (the rotated width: what RoPE's frequencies are computed over)
Attention is multi-head latent attention (deepseek.py); its own fields are q_lora_rank (None: one q_proj),
kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim. The KV cache holds per token and layer the
normalised latent (kv_lora_rank) and the rotated key (qk_rope_head_dim), nothing per head.

Dense layers: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0 (DeepSeek's rule;
transformers' classes know only first_k_dense_replace, i.e. moe_layer_freq 1).

Routers: V3 scores experts with a sigmoid, picks by score + e_score_correction_bias within the topk_group
best of n_group groups (a group's score: its two best biased scores), weighs by the unbiased scores
(renormalised if norm_topk_prob) times routed_scaling_factor. V2 scores with a softmax, picks greedily or
within the topk_group best groups (a group's score: its best expert), weighs by the softmax times
routed_scaling_factor. What Locus does not implement is refused in one line naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from locus.engine.model.config_base import ROPE_TYPES, ModelConfig, as_int_tuple, parse_rope
from locus.errors import LocusError

V3, V2 = "deepseek_v3", "deepseek_v2"
MODEL_TYPES = (V3, V2)
DEEPSEEK_ROPE_TYPES = (*ROPE_TYPES, "yarn")
# The selection rule per model type: V3's sigmoid with bias, V2's two softmax rules.
TOPK_METHODS = {V3: ("noaux_tc",), V2: ("greedy", "group_limited_greedy")}
SCORING = {V3: "sigmoid", V2: "softmax"}

# transformers' defaults, by config.json name, per model type.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    V3: dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
             num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
             routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
             qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
             norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=0,
             eos_token_id=1, rope_theta=10000.0, rope_interleave=True, topk_method="noaux_tc"),
    V2: dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407,
             num_hidden_layers=32, num_attention_heads=32, n_shared_experts=2, n_routed_experts=64,
             routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
             qk_nope_head_dim=128, n_group=None, topk_group=None, num_experts_per_tok=None, first_k_dense_replace=0,
             norm_topk_prob=False, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, rope_theta=10000.0, rope_interleave=True, topk_method="greedy"),
}


@dataclass(frozen=True)
class DeepseekModelConfig(ModelConfig):
    """Built directly (a preset) or by parse_deepseek. Left empty, `moe_layers` and `no_rope_layers` are
    filled by the family's rules; given, they must equal them."""

    family: ClassVar[str] = "deepseek"
    rope_types: ClassVar[tuple[str, ...]] = DEEPSEEK_ROPE_TYPES
    model_type: str = V3
    attention_chunk_size: int | None = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rope_interleave: bool = True  # V3: the rotated dims are adjacent pairs (False: halves); V2: always pairs

    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        problems = []
        if self.model_type not in MODEL_TYPES:
            problems.append(f"model_type {self.model_type!r} is not a DeepSeek one ({', '.join(MODEL_TYPES)})")
        elif self.topk_method not in TOPK_METHODS[self.model_type]:
            problems.append(f"topk_method {self.topk_method!r} is not supported for {self.model_type} "
                            f"(supported: {', '.join(TOPK_METHODS[self.model_type])})")
        if self.moe_layer_freq < 1:
            problems.append(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        if self.first_k_dense_replace < 0:
            problems.append(f"first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}")
        if self.n_group < 1 or self.num_local_experts % self.n_group:
            problems.append(f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_local_experts})")
        elif not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        elif self.model_type == V3 and self.num_local_experts // self.n_group < 2:
            problems.append("V3's group score sums each group's two best experts: n_routed_experts / n_group must be >= 2")
        elif self.num_experts_per_tok > self.topk_group * (self.num_local_experts // self.n_group):
            problems.append(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group "
                            f"({self.topk_group}) groups")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_shared_experts"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE rotates pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            problems.append(f"q_lora_rank must be >= 1 or null, got {self.q_lora_rank}")
        if self.head_dim != self.qk_rope_head_dim:
            problems.append(f"head_dim ({self.head_dim}) must equal qk_rope_head_dim ({self.qk_rope_head_dim})")
        if problems:
            raise LocusError("invalid model config: " + "; ".join(problems))
        rule = deepseek_moe_layers(L, self.first_k_dense_replace, self.moe_layer_freq)
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", rule)
        if not self.no_rope_layers:
            object.__setattr__(self, "no_rope_layers", (1,) * L)
        super().__post_init__()
        if self.moe_layers != rule:
            raise LocusError(f"invalid model config: moe_layers {list(self.moe_layers)} disagree with "
                             f"first_k_dense_replace / moe_layer_freq ({list(rule)})")
        if self.no_rope_layers != (1,) * L or self.attention_chunk_size is not None or self.use_qk_norm \
                or self.attn_temperature_tuning:
            raise LocusError("invalid model config: no_rope_layers, attention_chunk_size, use_qk_norm and "
                             "attn_temperature_tuning are Llama-4's rules, off in DeepSeek")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        # The cache's "keys" hold the latent, its "values" the rotated key: one row each per token.
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)

    def to_hf_dict(self) -> dict[str, Any]:
        """A DeepseekV3Config / DeepseekV2Config-style dict (what save_checkpoint writes; transformers reads it)."""
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type != "default":
            rope["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope.update(low_freq_factor=self.rope.low_freq_factor, high_freq_factor=self.rope.high_freq_factor)
        if self.rope.rope_type in ("llama3", "yarn"):
            rope["original_max_position_embeddings"] = self.rope.original_max_position_embeddings
        if self.rope.rope_type == "yarn":
            rope.update(beta_fast=self.rope.beta_fast, beta_slow=self.rope.beta_slow, mscale=self.rope.mscale,
                        mscale_all_dim=self.rope.mscale_all_dim)
        arch = "DeepseekV3ForCausalLM" if self.model_type == V3 else "DeepseekV2ForCausalLM"
        d: dict[str, Any] = dict(
            model_type=self.model_type, architectures=[arch], hidden_act="silu",
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size_mlp,
            moe_intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps, n_routed_experts=self.num_local_experts,
            num_experts_per_tok=self.num_experts_per_tok, n_shared_experts=self.n_shared_experts,
            q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim,
            routed_scaling_factor=self.routed_scaling_factor, topk_method=self.topk_method, n_group=self.n_group,
            topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
            first_k_dense_replace=self.first_k_dense_replace, moe_layer_freq=self.moe_layer_freq,
            attention_bias=self.attention_bias, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, rope_parameters=rope, bos_token_id=self.bos_token_id,
            pad_token_id=self.pad_token_id,
            eos_token_id=list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        )
        if self.model_type == V3:
            d.update(rope_interleave=self.rope_interleave, scoring_func="sigmoid")
        if self.dtype:
            d["torch_dtype"] = self.dtype
        return d


def deepseek_moe_layers(num_layers: int, first_k_dense_replace: int, moe_layer_freq: int) -> tuple[int, ...]:
    """DeepSeek's rule: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    return tuple(i for i in range(num_layers) if i >= first_k_dense_replace and i % moe_layer_freq == 0)


def refusals(d: dict[str, Any], model_type: str) -> list[str]:
    """The fields whose values Locus does not implement, each as 'field: why'."""
    out = []
    act = d.get("hidden_act", "silu")
    if act != "silu":
        out.append(f"hidden_act {act!r} is not supported (Locus's MLPs and experts are SwiGLU: 'silu')")
    method = d.get("topk_method") or HF_DEFAULTS[model_type]["topk_method"]
    if method not in TOPK_METHODS[model_type]:
        out.append(f"topk_method {method!r} is not supported for {model_type} "
                   f"(supported: {', '.join(TOPK_METHODS[model_type])})")
    scoring = d.get("scoring_func") or SCORING[model_type]
    if scoring != SCORING[model_type]:
        out.append(f"scoring_func {scoring!r} is not supported for {model_type} (supported: {SCORING[model_type]!r})")
    if (d.get("ep_size") or 1) != 1:
        out.append(f"ep_size {d['ep_size']}: expert parallelism is Locus's own (--ep-ranks), not the checkpoint's")
    experts = d.get("n_routed_experts", d.get("num_local_experts"))
    if experts is not None and int(experts) < 1:
        out.append(f"n_routed_experts {experts} (a dense-only model) is not supported: Locus serves MoE models")
    if "n_routed_experts" in d and "num_local_experts" in d and d["n_routed_experts"] != d["num_local_experts"]:
        out.append(f"n_routed_experts ({d['n_routed_experts']}) and num_local_experts ({d['num_local_experts']}) disagree")
    if model_type == V2 and d.get("norm_topk_prob"):
        out.append("norm_topk_prob is true: transformers' DeepseekV2 router does not renormalise, and Locus follows it")
    if d.get("mlp_bias"):
        out.append("mlp_bias is true: Locus's MLPs have no bias")
    quant = d.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        block = list(quant.get("weight_block_size") or []) if isinstance(quant, dict) else []
        if method != "fp8" or block != [128, 128]:
            out.append(f"quantization_config: only fp8 with weight_block_size [128, 128] is supported "
                       f"(got quant_method {method!r}, weight_block_size {block or None})")
        elif quant.get("activation_scheme", "dynamic") != "dynamic":
            out.append(f"quantization_config: activation_scheme {quant['activation_scheme']!r} is not supported "
                       "(Locus dequantizes the weights at load: 'dynamic')")
    return out


def parse_deepseek(d: dict[str, Any], where: str) -> DeepseekModelConfig:
    """A DeepseekV3Config / DeepseekV2Config dict -> DeepseekModelConfig; an unsupported value is one
    LocusError naming the field."""
    model_type = d["model_type"]
    problems = refusals(d, model_type)
    if problems:
        raise LocusError(f"{where}: " + "; ".join(problems))
    defaults = HF_DEFAULTS[model_type]

    def get(name: str) -> Any:
        value = d.get(name)
        return defaults.get(name) if value is None else value

    try:
        L = int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        experts = int(d.get("n_routed_experts") or d.get("num_local_experts") or defaults["n_routed_experts"])
        top_k = get("num_experts_per_tok")
        if top_k is None:
            raise LocusError(f"{where}: num_experts_per_tok is missing (DeepseekV2Config has no default)")
        method = d.get("topk_method") or defaults["topk_method"]
        grouped = model_type == V3 or method == "group_limited_greedy"
        n_group = int(get("n_group") or 1) if grouped else 1
        topk_group = int(get("topk_group") or 1) if grouped else 1
        q_lora = d.get("q_lora_rank", defaults["q_lora_rank"])
        rope_dim = int(get("qk_rope_head_dim"))
        rope_fields = {**d, "rope_theta": get("rope_theta")}
        return DeepseekModelConfig(
            model_type=model_type,
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("moe_intermediate_size")),
            intermediate_size_mlp=int(get("intermediate_size")),
            num_hidden_layers=L,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=rope_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            num_local_experts=experts,
            num_experts_per_tok=int(top_k),
            attention_bias=bool(d.get("attention_bias", False)),
            max_position_embeddings=int(get("max_position_embeddings")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            rope=parse_rope(rope_fields, where, DEEPSEEK_ROPE_TYPES),
            bos_token_id=d.get("bos_token_id", defaults["bos_token_id"]),
            eos_token_id=as_int_tuple(d.get("eos_token_id", defaults["eos_token_id"])),
            pad_token_id=d.get("pad_token_id"),
            dtype=d.get("torch_dtype") or d.get("dtype"),
            q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(get("v_head_dim")),
            n_shared_experts=int(get("n_shared_experts")),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            topk_method=method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=bool(get("norm_topk_prob")) if model_type == V3 else False,
            first_k_dense_replace=int(get("first_k_dense_replace")),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            rope_interleave=bool(get("rope_interleave")) if model_type == V3 else True,
        )
    except (TypeError, ValueError) as exc:
        raise LocusError(f"{where}: {exc}") from None
    except LocusError as exc:  # the dataclass's own checks, which do not know the file
        if str(exc).startswith(where):
            raise
        raise LocusError(f"{where}: {exc}") from None

