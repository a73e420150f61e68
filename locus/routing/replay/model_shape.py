"""A model's shape as the decode step-time model needs it: what a trace's meta.json does not hold (the
attention's heads, the dense layers, the vocabulary), and the bytes and FLOPs derived from it.

Shapes come from model_shapes.json beside this file (each with the published config.json it copies)
or from a JSON file holding one shape record. A shape is checked once, where it is loaded, and against
the trace it is used with (hidden size, experts, top-k and MoE layer count must agree).

Shape legend: H hidden, I routed-expert width, E experts, V vocabulary; "a token's layer" is one
token through one decoder layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from locus.errors import LocusError

SHAPES_FILE = Path(__file__).with_name("model_shapes.json")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V3): the KV cache holds kv_lora_rank + qk_rope_head_dim
    a token and layer, and the projections go through the two low-rank bottlenecks."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    name: str
    source: str
    hidden_size: int
    moe_intermediate_size: int  # a routed expert's width I
    num_hidden_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    dense_intermediate_size: int  # a dense layer's FFN width (0: every layer is MoE)
    shared_intermediate_size: int  # the shared experts' total width in a MoE layer (0: none)
    vocab_size: int
    tie_word_embeddings: bool = False
    dtype_bytes: int = 2  # weights and KV cache as served
    mla: MlaShape | None = None

    @property
    def expert_bytes(self) -> int:
        """One routed expert's weights: gate, up and down, H x I each."""
        return 3 * self.hidden_size * self.moe_intermediate_size * self.dtype_bytes

    @property
    def expert_flops_per_token(self) -> int:
        """FLOPs one token costs one routed expert (two per multiply-add, three H x I products)."""
        return 6 * self.hidden_size * self.moe_intermediate_size

    @property
    def attention_params(self) -> int:
        """One decoder layer's attention projection weights."""
        H = self.hidden_size
        if self.mla is None:
            q = self.num_attention_heads * self.head_dim
            return H * q + 2 * H * self.num_key_value_heads * self.head_dim + q * H
        m, n = self.mla, self.num_attention_heads
        return (H * m.q_lora_rank + m.q_lora_rank * n * (m.qk_nope_head_dim + m.qk_rope_head_dim)
                + H * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
                + n * m.v_head_dim * H)

    @property
    def dense_params(self) -> int:
        """Weights every rank reads once a step whatever its tokens (data-parallel attention): the
        attention projections, the dense layers' FFNs, the shared experts, the routers and lm_head
        (the embedding is a gather, not a read of the table)."""
        H = self.hidden_size
        dense_layers = self.num_hidden_layers - self.num_moe_layers
        return (self.num_hidden_layers * self.attention_params
                + dense_layers * 3 * H * self.dense_intermediate_size
                + self.num_moe_layers * (3 * H * self.shared_intermediate_size + H * self.num_experts)
                + self.vocab_size * H)

    @property
    def dense_bytes(self) -> int:
        return self.dense_params * self.dtype_bytes

    @property
    def dense_flops_per_token(self) -> int:
        return 2 * self.dense_params

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache one token of context holds, all layers: what decode attention reads per context token."""
        if self.mla is None:
            per_layer = 2 * self.num_key_value_heads * self.head_dim
        else:
            per_layer = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return self.num_hidden_layers * per_layer * self.dtype_bytes

    def check_trace(self, meta) -> None:
        """Refuse a trace of another model: its hidden size, experts, top-k and MoE layer count must be these."""
        for what, mine, theirs in (("hidden_size", self.hidden_size, meta.hidden_size),
                                   ("num_experts", self.num_experts, meta.num_experts),
                                   ("top_k", self.top_k, meta.top_k),
                                   ("MoE layers", self.num_moe_layers, len(meta.moe_layers))):
            if mine != theirs:
                raise LocusError(f"model shape {self.name!r} has {what} {mine}, the trace {theirs}: give the trace's "
                                 "model with --model-shape")


def shape_names() -> list[str]:
    return sorted(_table())


def load_model_shape(spec: str) -> ModelShape:
    """A shape by name (model_shapes.json) or from a JSON file holding one shape record."""
    table = _table()
    if spec in table:
        return parse_shape(spec, table[spec], SHAPES_FILE.name)
    path = Path(spec)
    if not path.is_file():
        raise LocusError(f"model shape {spec!r}: neither a known model ({', '.join(sorted(table))}) nor a file")
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LocusError(f"model shape {path}: cannot read it as JSON ({exc})") from None
    return parse_shape(path.stem, record, str(path))


def parse_shape(name: str, record, where: str) -> ModelShape:
    """One shape record, every field checked (the error names the file, the shape and the field)."""
    if not isinstance(record, dict):
        raise LocusError(f"{where}: shape {name!r} must be a JSON object")
    known = {f.name for f in fields(ModelShape)} - {"name"}
    if unknown := sorted(set(record) - known):
        raise LocusError(f"{where}: shape {name!r} has unknown field {unknown[0]!r}")
    values: dict = {"name": name}
    for f in fields(ModelShape):
        if f.name in ("name", "mla"):
            continue
        if f.name not in record:
            if f.name in ("tie_word_embeddings", "dtype_bytes"):
                continue
            raise LocusError(f"{where}: shape {name!r} lacks {f.name!r}")
        value = record[f.name]
        if f.name == "source":
            if not isinstance(value, str) or not value.strip():
                raise LocusError(f"{where}: shape {name!r}: 'source' must name where its figures come from")
        elif f.name == "tie_word_embeddings":
            if not isinstance(value, bool):
                raise LocusError(f"{where}: shape {name!r}: 'tie_word_embeddings' must be true or false")
        else:
            zero_ok = f.name in ("dense_intermediate_size", "shared_intermediate_size")
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero_ok else 1):
                raise LocusError(f"{where}: shape {name!r}: {f.name!r} must be a {'non-negative' if zero_ok else 'positive'} "
                                 f"integer, got {value!r}")
        values[f.name] = value
    if values["num_moe_layers"] > values["num_hidden_layers"]:
        raise LocusError(f"{where}: shape {name!r} has more MoE layers than layers")
    if values["top_k"] > values["num_experts"]:
        raise LocusError(f"{where}: shape {name!r}: top_k exceeds num_experts")
    if values["num_moe_layers"] < values["num_hidden_layers"] and values["dense_intermediate_size"] == 0:
        raise LocusError(f"{where}: shape {name!r} has dense layers and a dense_intermediate_size of 0")
    if "mla" in record:
        mla = record["mla"]
        if not isinstance(mla, dict) or sorted(mla) != sorted(MLA_FIELDS):
            raise LocusError(f"{where}: shape {name!r}: 'mla' must hold exactly {', '.join(MLA_FIELDS)}")
        for key in MLA_FIELDS:
            if isinstance(mla[key], bool) or not isinstance(mla[key], int) or mla[key] < 1:
                raise LocusError(f"{where}: shape {name!r}: mla {key!r} must be a positive integer")
        values["mla"] = MlaShape(**{k: mla[k] for k in MLA_FIELDS})
    return ModelShape(**values)


def _table() -> dict:
    doc = json.loads(SHAPES_FILE.read_text())
    return doc["shapes"]
