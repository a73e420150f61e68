"""Resolve `--model DIR|preset` into a ready model and its tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from locus.engine.model.config import ModelConfig, load_config
from locus.engine.model.slices import ExpertSlices
from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.checkpoint.quantize import quantize_model_experts
from locus.engine.checkpoint.tokenizer import Tokenizer, load_tokenizer
from locus.engine.checkpoint.weights import load_model, resolve_dtype
from locus.errors import LocusError

log = logging.getLogger("locus.engine")

DEFAULT_MODEL = "tiny"
# Checkpoints that ship inside the package, by name. `mini` is the small trained model of
# `locus train` (locus/assets/mini/README.md); it is what `locus serve` serves without --model.
ASSETS = Path(__file__).resolve().parents[2] / "assets"
SHIPPED = {"mini": ASSETS / "mini"}


def shipped_model(name: str) -> Path | None:
    """The directory of a shipped checkpoint, or None when `name` is not one or it is not installed."""
    path = SHIPPED.get(name)
    return path if path is not None and (path / "config.json").is_file() else None


def default_serve_model() -> str:
    """What `locus serve` serves without --model: the shipped trained `mini` when present, else `tiny`."""
    return "mini" if shipped_model("mini") else DEFAULT_MODEL


@dataclass
class LoadedModel:
    model: Llama4ForCausalLM
    tokenizer: Tokenizer
    name: str  # what /v1/models reports
    random_weights: bool  # True for presets


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def config_of(model: str | None) -> ModelConfig:
    """The config `load(model)` would build, without any weight."""
    name = model or DEFAULT_MODEL
    if Path(name).is_dir():
        return load_config(Path(name))
    if name in SHIPPED:
        return load_config(_shipped_dir(name))
    if name in PRESETS:
        return PRESETS[name]
    raise _no_such_model(name)


def load(model: str | None = None, dtype: str | torch.dtype | None = None, device: str | None = None,
         moe_backend: str = "auto", seed: int = 0, expert_slices: ExpertSlices | None = None,
         quantize_experts: str | None = None, draw_on_device: bool = False) -> LoadedModel:
    """A checkpoint directory, a shipped checkpoint's name (`mini`), or a preset name (random weights);
    None = the embedded `tiny` preset.
    expert_slices: an expert-parallel rank's experts, the only ones loaded (expert_slices.py).
    quantize_experts: hold the routed experts (only the held ones) in fp8, mxfp8 or mxfp4 (quantize.py).
    draw_on_device: a preset's weights are drawn on the device itself (build_preset)."""
    loaded = _load(model, dtype, device, moe_backend, seed, expert_slices, draw_on_device)
    if quantize_experts:
        log.info("%s", quantize_model_experts(loaded.model, quantize_experts).describe())
    return loaded


def _load(model, dtype, device, moe_backend, seed, expert_slices, draw_on_device) -> LoadedModel:
    device = device or default_device()
    name = model or DEFAULT_MODEL
    path = Path(name)
    if not path.is_dir() and name in SHIPPED:
        path = _shipped_dir(name)
    if path.is_dir():
        m = load_model(path, dtype=resolve_dtype(dtype) if dtype else None, device=device, moe_backend=moe_backend,
                       expert_slices=expert_slices)
        tok = load_tokenizer(path, m.config.vocab_size, m.config.eos_token_ids)
        return LoadedModel(m, tok, name=name if name in SHIPPED else str(path).rstrip("/").split("/")[-1] or str(path),
                           random_weights=False)
    if name in PRESETS:
        m = build_preset(name, seed=seed, dtype=resolve_dtype(dtype or PRESETS[name].dtype), device=device,
                         moe_backend=moe_backend, expert_slices=expert_slices, draw_on_device=draw_on_device)
        return LoadedModel(m, load_tokenizer(None, m.config.vocab_size), name=name, random_weights=True)
    raise _no_such_model(name)


def _shipped_dir(name: str) -> Path:
    path = shipped_model(name)
    if path is None:
        raise LocusError(f"--model {name}: the shipped checkpoint is missing from this installation ({SHIPPED[name]}); "
                         f"train one with `locus train --out DIR` and copy DIR/model there")
    return path


def _no_such_model(name: str) -> LocusError:
    return LocusError(f"--model {name!r}: no such checkpoint directory, and not a shipped checkpoint "
                      f"({', '.join(SHIPPED)}) or a preset ({', '.join(PRESETS)})")
