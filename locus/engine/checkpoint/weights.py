"""Checkpoint I/O: HuggingFace-format Llama-4 and Qwen3-MoE directories (config.json + safetensors).

A Qwen3-MoE checkpoint's tensor names are mapped to the model's (names.py); its experts come one by one.

Loading accepts what the public checkpoints and their exports contain:
- one or many `*.safetensors` shards (with `model.safetensors.index.json` when sharded);
- names with or without the multimodal `language_model.` prefix (vision tensors are skipped);
- experts fused (`...experts.gate_up_proj` [E, H, 2I], `...experts.down_proj` [E, I, H]) or one by one
  (`...experts.{j}.{gate,up,down}_proj.weight` in nn.Linear's [out, in] layout).
An expert-parallel rank passes its expert slices: it then reads only its slots' experts (safetensors
slices of the fused tensors, or only the per-expert tensors it needs). Every tensor's shape is checked against the config; any problem is one LocusError naming the file
or tensor. Pre-quantized checkpoints (Meta's FBGEMM FP8, gpt-oss-style MXFP4 experts) are read by
quantized.py. Saving writes the same format (fused or per-expert, optionally prefixed) so that round
trips and re-exports can be tested.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from locus.engine.checkpoint.fp8_blocks import BlockFp8Reader, is_block_fp8, take_scales
from locus.engine.checkpoint.names import experts_per_expert, to_checkpoint_name, to_model_name
from locus.engine.checkpoint.quantize import expert_kernel_path
from locus.engine.checkpoint.quantized import quantized_experts, quantized_linears, read_experts, read_fp8_linear, \
    read_quantization
from locus.engine.model.config import load_config
from locus.engine.model.families import family_of
from locus.engine.model.slices import ExpertSlices, keep_slices
from locus.engine.model.model import Llama4ForCausalLM
from locus.errors import LocusError

log = logging.getLogger("locus.engine")

INDEX_FILE = "model.safetensors.index.json"
PREFIX = "language_model."
# Tensors of the multimodal checkpoints that the text model does not use.
SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")
FUSED = re.compile(r"^(model\.layers\.\d+\.feed_forward\.experts)\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.feed_forward\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def find_shards(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise LocusError(f"{index}: not a valid safetensors index ({exc})") from None
        shards = sorted({model_dir / name for name in weight_map.values()})
        for shard in shards:
            if not shard.is_file():
                raise LocusError(f"{shard}: shard listed in {INDEX_FILE} is missing")
        return shards
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise LocusError(f"{model_dir}: no *.safetensors weight files")
    return shards


def read_tensors(shards: list[Path], rename=None) -> dict[str, tuple[Path, str]]:
    """Canonical tensor name -> (shard, name in that shard), after opening (and so checking) every shard.
    rename: the family's checkpoint name -> the model's parameter name (names.py); None keeps names."""
    found: dict[str, tuple[Path, str]] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as exc:
            raise LocusError(f"{shard}: unreadable safetensors file ({exc}); truncated or corrupt?") from None
        for name in names:
            canonical = name[len(PREFIX):] if name.startswith(PREFIX) else name
            if canonical.startswith(SKIPPED_PREFIXES):
                continue
            if rename is not None:
                try:
                    canonical = rename(canonical)
                except LocusError as exc:
                    raise LocusError(f"{shard}: {exc}") from None
                if canonical is None:  # a tensor the family reads past (names.py)
                    continue
            if canonical in found:
                raise LocusError(f"{shard}: tensor {name!r} also appears in {found[canonical][0]}")
            found[canonical] = (shard, name)
    return found


class _ShardReader:
    """Keeps each shard open once while tensors are pulled from it."""

    def __init__(self) -> None:
        self._open: dict[Path, object] = {}

    def get(self, shard: Path, name: str) -> torch.Tensor:
        return self._read(shard, name, lambda f: f.get_tensor(name))

    def get_rows(self, shard: Path, name: str, rows: list[int], full_shape: tuple[int, ...]) -> torch.Tensor:
        """tensor[rows] of a [E, ...] tensor, reading only those rows from the file."""
        def rows_of(f) -> torch.Tensor:
            view = f.get_slice(name)
            shape = tuple(view.get_shape())
            if shape != full_shape:
                raise LocusError(f"{shard}: tensor {name!r} has shape {shape}, config.json implies {full_shape}")
            return torch.cat([view[e:e + 1] for e in rows])

        return self._read(shard, name, rows_of)

    def _read(self, shard: Path, name: str, read):
        """read(the open shard), with safetensors' failures as one LocusError naming file and tensor."""
        if shard not in self._open:
            self._open[shard] = safe_open(str(shard), framework="pt")
        try:
            return read(self._open[shard])
        except (SafetensorError, OSError) as exc:
            raise LocusError(f"{shard}: cannot read tensor {name!r} ({exc}); truncated or corrupt?") from None


def load_model(model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               moe_backend: str = "torch", expert_slices: ExpertSlices | None = None) -> Llama4ForCausalLM:
    """Build the model from a checkpoint directory. dtype None: the checkpoint's (float32 if unstated).
    expert_slices: hold (and read) only these experts of each MoE layer, in this order."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise LocusError(f"{model_dir}: no such checkpoint directory")
    config = load_config(model_dir)
    dtype = dtype or resolve_dtype(config.dtype)
    family = family_of(config)
    found = read_tensors(find_shards(model_dir), None if config.family == "llama4" else
                         lambda name: to_model_name(config, name))

    block_fp8 = config.family == "deepseek" and is_block_fp8(model_dir)
    scales = take_scales(found) if block_fp8 else {}
    quant = None if block_fp8 else read_quantization(model_dir)
    if quant is not None and config.family != "llama4":
        raise LocusError(f"{model_dir}: quantization_config ({quant.method}): pre-quantized {family.label} "
                         "checkpoints are not supported (load the float checkpoint; --quantize-experts narrows its experts)")
    with torch.device("meta"):
        model = Llama4ForCausalLM(config, moe_backend)
    if expert_slices is not None:
        keep_slices(model, expert_slices)
    narrow_experts = quantized_experts(model, quant)
    for experts in narrow_experts.values():
        experts.expect_quantized()
    model.to_empty(device=device)
    model.to(dtype)
    model.tie_weights()
    reader = BlockFp8Reader(_ShardReader(), scales) if block_fp8 else _ShardReader()
    shown = (lambda name: name) if config.family == "llama4" else (lambda name: to_checkpoint_name(config, name))
    expected = dict(model.named_parameters(remove_duplicate=False))
    narrow_linears = quantized_linears(model, quant) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    used: set[str] = set()
    with torch.no_grad():
        for name, param in expected.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # shares embed_tokens.weight
            rows = _held_rows(model, name)
            if name in narrow_linears:
                tensor = read_fp8_linear(name, tuple(param.shape), found, reader, used, dtype)
            elif rows is None:
                tensor = _fetch(name, param, found, reader, used, shown)
            else:
                tensor = _fetch_rows(name, rows, config.num_local_experts, param, found, reader, used, shown)
            if tuple(tensor.shape) != tuple(param.shape):
                raise LocusError(f"{model_dir}: tensor {shown(name)!r} has shape {tuple(tensor.shape)}, config.json implies {tuple(param.shape)}")
            if not tensor.is_floating_point() or tensor.element_size() == 1:
                raise LocusError(f"{model_dir}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, but "
                                 f"{'config.json has no quantization_config' if quant is None else 'quantization_config keeps its module unconverted'}")
            param.copy_(tensor)
        for base, experts in narrow_experts.items():
            rows = experts.expert_ids if experts.expert_ids is not None else list(range(config.num_local_experts))
            gate_up, down = read_experts(base, config.num_local_experts, rows, config.hidden_size,
                                         config.intermediate_size, quant, found, reader, used)
            experts.hold_quantized(gate_up.to(device), down.to(device))
    if quant is not None:
        _note_quantization(model, quant, narrow_linears, narrow_experts)
    leftover = sorted(shown(name) for name in set(found) - used - {"lm_head.weight"})
    if block_fp8:
        leftover += reader.unused_scales()
    if leftover:
        raise LocusError(f"{model_dir}: tensors the {family.label} model does not have: {', '.join(leftover[:5])}"
                         + (f" and {len(leftover) - 5} more" if len(leftover) > 5 else ""))
    return model.eval()


def _note_quantization(model: Llama4ForCausalLM, quant, linears: set[str], experts: dict) -> None:
    """Say what a pre-quantized checkpoint became and which kernel reads its experts (every MoE
    backend reads them narrow)."""
    if linears:
        log.info("%s checkpoint: %d FP8 linear weights dequantized to %s at load (only the routed experts run "
                 "in a narrow format)", quant.method, len(linears), str(model.dtype).removeprefix("torch."))
    if not experts:
        return
    fmt = next(iter(experts.values())).weight_format
    log.info("%s checkpoint: routed experts of %d MoE layers held in %s; %s", quant.method, len(experts), fmt,
             expert_kernel_path(model, fmt))


def _held_rows(model: Llama4ForCausalLM, name: str) -> list[int] | None:
    """The expert ids a sliced expert tensor holds; None for any other tensor (read whole)."""
    match = FUSED.match(name)
    if not match:
        return None
    return model.get_submodule(match.group(1)).expert_ids


def _fetch(name: str, param: torch.Tensor, found: dict, reader: _ShardReader, used: set[str],
           shown=lambda name: name) -> torch.Tensor:
    """shown: the checkpoint's name of a model parameter name, for the errors (names.py)."""
    if name in found:
        used.add(name)
        return reader.get(*found[name])
    if not FUSED.match(name):
        raise LocusError(f"checkpoint is missing tensor {shown(name)!r}")
    return _fetch_rows(name, list(range(param.shape[0])), param.shape[0], param, found, reader, used, shown)


def _fetch_rows(name: str, rows: list[int], num_experts: int, param: torch.Tensor, found: dict, reader: _ShardReader,
                used: set[str], shown=lambda name: name) -> torch.Tensor:
    """Rows `rows` of a fused expert tensor [E, ...]: sliced from the fused tensor, or assembled from
    the per-expert [out, in] tensors (whose presence is checked for every expert, read or not)."""
    full_shape = (num_experts, *param.shape[1:])
    if name in found:
        used.add(name)
        return reader.get_rows(*found[name], rows, full_shape)
    base, kind = FUSED.match(name).groups()
    parts = ("gate", "up") if kind == "gate_up_proj" else ("down",)
    keys = {j: [f"{base}.{j}.{part}_proj.weight" for part in parts] for j in range(num_experts)}
    for j in range(num_experts):
        for key in keys[j]:
            if key not in found:
                raise LocusError(f"checkpoint is missing tensor {shown(name)!r} (and per-expert {shown(key)!r})")
            used.add(key)
    out = []
    for j in rows:
        out.append(torch.cat([reader.get(*found[key]).t() for key in keys[j]], dim=1))  # [out, in] -> [in, out]
    return torch.stack(out)


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {None: torch.float32, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if name not in table:
        raise LocusError(f"unsupported dtype {name!r} (choose float32, bfloat16 or float16)")
    return table[name]


def checkpoint_tensors(model: Llama4ForCausalLM, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """The tensors save_checkpoint writes, in checkpoint naming (without prefix). A family whose
    checkpoints hold experts one by one (names.py) is written so whatever per_expert says."""
    per_expert = per_expert or experts_per_expert(model.config)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        match = re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)$", name)
        if per_expert and match:
            base, kind = match.groups()
            I = model.config.intermediate_size
            base = to_checkpoint_name(model.config, base)
            for j in range(tensor.shape[0]):
                if kind == "gate_up_proj":
                    out[f"{base}.{j}.gate_proj.weight"] = tensor[j, :, :I].t().contiguous()
                    out[f"{base}.{j}.up_proj.weight"] = tensor[j, :, I:].t().contiguous()
                else:
                    out[f"{base}.{j}.down_proj.weight"] = tensor[j].t().contiguous()
            continue
        out[to_checkpoint_name(model.config, name)] = tensor.detach().contiguous()
    return out


def save_checkpoint(model: Llama4ForCausalLM, out_dir: str | Path, per_expert: bool = False,
                    prefix: str = "", max_shard_bytes: int = 2 << 30) -> Path:
    """Write config.json + safetensors shards (+ index when sharded). Atomic: a failure leaves no half-written dir."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise LocusError(f"{out_dir}: exists and is not empty; refusing to overwrite")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tensors = {prefix + k: v for k, v in checkpoint_tensors(model, per_expert).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    config = model.config.to_hf_dict()
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for f in tmp.iterdir():  # mkdtemp and safetensors create private files; a checkpoint is meant to be shared
        f.chmod(0o644)
    tmp.chmod(0o755)
    if out_dir.exists():
        out_dir.rmdir()
    os.replace(tmp, out_dir)
    return out_dir
