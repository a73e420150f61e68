"""Qwen3-MoE model configuration (`model_type: qwen3_moe`, transformers' `Qwen3MoeConfig`).

The family shares Locus's `ModelConfig` fields where they mean the same thing, so the engine (KV cache,
slices, expert parallelism, trace recorder) reads one shape:
    moe_intermediate_size -> intermediate_size (the routed experts' width)
    intermediate_size     -> intermediate_size_mlp (the dense layers' width)
    num_experts           -> num_local_experts
and the Llama-4-only rules are off: every layer uses RoPE, no attention chunks, no temperature tuning,
no Llama-4 qk-norm (Qwen3 normalises q and k per head with weights: qwen3.py). Qwen3's own fields:
the softmax router's `norm_topk_prob`, and the dense-layer rule (`decoder_sparse_step`,
`mlp_only_layers`), resolved here into `moe_layers`. Defaults are transformers' `Qwen3MoeConfig`'s, so a
sparse config.json means the same here. What Locus does not implement is refused in one line naming
the field (`refusals` below).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from locus.engine.model.config_base import ModelConfig, as_int_tuple, parse_rope
from locus.errors import LocusError

MODEL_TYPE = "qwen3_moe"

# transformers' Qwen3MoeConfig defaults, by config.json name.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, hidden_act="silu",
    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    use_sliding_window=False, decoder_sparse_step=1, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=False, rope_theta=10000.0,
)


@dataclass(frozen=True)
class Qwen3MoeModelConfig(ModelConfig):
    """Built directly (a preset) or by parse_qwen3_moe. Left empty, `moe_layers` and `no_rope_layers` are
    filled by the family's rules; given, they must equal them."""

    family: ClassVar[str] = MODEL_TYPE
    # Llama-4's rules, off in this family (the base class's defaults are Llama-4's).
    attention_chunk_size: int | None = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    norm_topk_prob: bool = False  # renormalise the top-k softmax probabilities to sum to 1
    decoder_sparse_step: int = 1  # with mlp_only_layers, the dense-layer rule that gives moe_layers
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        if self.decoder_sparse_step < 1:
            raise LocusError(f"invalid model config: decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
        if any(not 0 <= i < L for i in self.mlp_only_layers):
            raise LocusError(f"invalid model config: mlp_only_layers {list(self.mlp_only_layers)} names a layer "
                             f"outside 0..{L - 1}")
        rule = qwen3_moe_layers(L, self.num_local_experts, self.decoder_sparse_step, self.mlp_only_layers)
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", rule)
        if not self.no_rope_layers:
            object.__setattr__(self, "no_rope_layers", (1,) * L)
        super().__post_init__()
        problems = []
        if self.moe_layers != rule:
            problems.append(f"moe_layers {list(self.moe_layers)} disagree with decoder_sparse_step / mlp_only_layers "
                            f"({list(rule)})")
        if self.no_rope_layers != (1,) * L:
            problems.append("no_rope_layers: every Qwen3-MoE layer uses RoPE")
        if self.attention_chunk_size is not None or self.use_qk_norm or self.attn_temperature_tuning:
            problems.append("attention_chunk_size, use_qk_norm and attn_temperature_tuning are Llama-4's rules, "
                            "off in Qwen3-MoE")
        if problems:
            raise LocusError("invalid model config: " + "; ".join(problems))

    def to_hf_dict(self) -> dict[str, Any]:
        """A `Qwen3MoeConfig`-style dict (what save_checkpoint writes as config.json; transformers reads it)."""
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type in ("linear", "llama3"):
            rope["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope.update(low_freq_factor=self.rope.low_freq_factor, high_freq_factor=self.rope.high_freq_factor,
                        original_max_position_embeddings=self.rope.original_max_position_embeddings)
        d: dict[str, Any] = dict(
            model_type=MODEL_TYPE, architectures=["Qwen3MoeForCausalLM"], hidden_act="silu",
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size_mlp,
            moe_intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, num_experts=self.num_local_experts,
            num_experts_per_tok=self.num_experts_per_tok, norm_topk_prob=self.norm_topk_prob,
            decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
            attention_bias=self.attention_bias, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, use_sliding_window=False, sliding_window=None,
            rope_parameters=rope, bos_token_id=self.bos_token_id, pad_token_id=self.pad_token_id,
            eos_token_id=list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        )
        if self.dtype:
            d["torch_dtype"] = self.dtype
        return d


def qwen3_moe_layers(num_layers: int, num_experts: int, decoder_sparse_step: int,
                     mlp_only_layers: tuple[int, ...]) -> tuple[int, ...]:
    """transformers' rule: layer i is MoE iff it is not in mlp_only_layers, there are experts, and
    (i + 1) is a multiple of decoder_sparse_step."""
    if num_experts <= 0:
        return ()
    return tuple(i for i in range(num_layers) if i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)


def refusals(d: dict[str, Any]) -> list[str]:
    """The fields whose values Locus does not implement, each as 'field: why'."""
    out = []
    if d.get("use_sliding_window"):
        out.append("use_sliding_window is true: Locus does not implement Qwen3's sliding-window attention")
    act = d.get("hidden_act", HF_DEFAULTS["hidden_act"])
    if act != "silu":
        out.append(f"hidden_act {act!r} is not supported (Locus's MLPs and experts are SwiGLU: 'silu')")
    experts = d.get("num_experts", d.get("num_local_experts", HF_DEFAULTS["num_experts"]))
    if isinstance(experts, int) and experts < 1:
        out.append(f"num_experts {experts} (a dense-only model) is not supported: Locus serves MoE models")
    if "num_experts" in d and "num_local_experts" in d and d["num_experts"] != d["num_local_experts"]:
        out.append(f"num_experts ({d['num_experts']}) and num_local_experts ({d['num_local_experts']}) disagree")
    return out


def parse_qwen3_moe(d: dict[str, Any], where: str) -> Qwen3MoeModelConfig:
    """A Qwen3MoeConfig dict -> Qwen3MoeModelConfig; an unsupported value is one LocusError naming the field."""
    problems = refusals(d)
    if problems:
        raise LocusError(f"{where}: " + "; ".join(problems))

    def get(name: str) -> Any:
        value = d.get(name)
        return HF_DEFAULTS[name] if value is None else value

    try:
        L = int(get("num_hidden_layers"))
        experts = int(d.get("num_experts") if d.get("num_experts") is not None else
                      d.get("num_local_experts") or HF_DEFAULTS["num_experts"])
        step = int(get("decoder_sparse_step"))
        if step < 1:
            raise LocusError(f"{where}: decoder_sparse_step must be >= 1, got {step}")
        mlp_only = as_int_tuple(d.get("mlp_only_layers"))  # moe_layers follow from it in __post_init__
        heads = int(get("num_attention_heads"))
        # Qwen3's RoPE base defaults to 10000 (Llama-4's to 500000): give parse_rope the family's default.
        rope_fields = {**d, "rope_theta": get("rope_theta")}
        return Qwen3MoeModelConfig(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size")),
            intermediate_size=int(get("moe_intermediate_size")),
            intermediate_size_mlp=int(get("intermediate_size")),
            num_hidden_layers=L,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads")),
            head_dim=int(d.get("head_dim") or int(get("hidden_size")) // heads),
            rms_norm_eps=float(get("rms_norm_eps")),
            num_local_experts=experts,
            num_experts_per_tok=int(get("num_experts_per_tok")),
            attention_bias=bool(get("attention_bias")),
            max_position_embeddings=int(get("max_position_embeddings")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            rope=parse_rope(rope_fields, where),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=as_int_tuple(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
            dtype=d.get("torch_dtype") or d.get("dtype"),
            norm_topk_prob=bool(get("norm_topk_prob")),
            decoder_sparse_step=step,
            mlp_only_layers=mlp_only,
        )
    except (TypeError, ValueError) as exc:
        raise LocusError(f"{where}: {exc}") from None
    except LocusError as exc:  # the dataclass's own checks, which do not know the file
        if str(exc).startswith(where):
            raise
        raise LocusError(f"{where}: {exc}") from None
