"""Rotary position embedding, Llama-4 flavour.

Llama-4 rotates *adjacent pairs*: dims (2m, 2m+1) of a head form one complex number, rotated by
angle pos * inv_freq[m] with inv_freq[m] = theta^(-2m/D). (Llama-2/3 in HF format rotate the two
halves instead; mixing the two up is the classic Llama-4 port bug.) The `llama3` rule rescales the
low frequencies for long context; `linear` divides all of them by `factor`; `yarn` (DeepSeek) blends
the original and the stretched frequencies over a band of dims and lengthens the rotation
(`yarn_attention_factor`). Qwen3-MoE rotates the halves (`apply_rope_halves`), with the same frequencies.
"""

from __future__ import annotations

import math

import torch

from locus.engine.model.config import RopeConfig


def compute_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[D/2] float32 inverse frequencies."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, head_dim, inv_freq)
    if rope.rope_type != "llama3":
        return inv_freq
    # llama3: wavelengths longer than the original context are stretched by `factor`, shorter than
    # original/high_freq_factor kept, the band between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(rope: RopeConfig) -> float:
    """The length yarn gives each rotation (cos and sin are multiplied by it); 1 for other rules."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_get_mscale(rope.factor)


def yarn_inv_freq(rope: RopeConfig, dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Dims rotating fewer than beta_slow times over the original context take the stretched frequency
    (divided by factor), more than beta_fast times the original one, a linear ramp between."""
    base, old_len = rope.theta, rope.original_max_position_embeddings

    def dim_of(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(dim_of(rope.beta_fast)), 0)
    high = min(math.ceil(dim_of(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a one-dim band would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the original frequency
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


def rotation(inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Unit rotations e^(i * pos * inv_freq) for absolute positions [T]: [T, D/2] complex64 eagerly;
    under torch.compile [T, D/2, 2] float32 (cos, sin), the same numbers as real pairs, because
    inductor generates no code for complex tensors. Eagerly the complex form is the faster one
    (7x on a 2,048-token prefill)."""
    angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    if torch.compiler.is_compiling():
        return torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [T, heads, D]: each pair (2m, 2m+1) = (a, b) is the complex number
    a + ib multiplied by its rotation, (a cos - b sin, a sin + b cos); computed in float32, cast back."""
    if rotations.is_complex():
        pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, heads, D/2]
        return torch.view_as_real(pairs * rotations[:, None, :]).flatten(-2).to(x.dtype)
    pairs = x.float().unflatten(-1, (-1, 2))  # [T, heads, D/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    cos, sin = rotations[:, None, :, 0], rotations[:, None, :, 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def apply_rope_halves(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] the HF Llama/Qwen way: dims m and m + D/2 form the pair (a, b) rotated by
    the same angles as `apply_rope`'s pair m (transformers' rotate_half); computed in float32, cast back."""
    if rotations.is_complex():
        cos, sin = rotations.real[:, None, :], rotations.imag[:, None, :]
    else:
        cos, sin = rotations[:, None, :, 0], rotations[:, None, :, 1]
    halves = x.float().unflatten(-1, (2, -1))  # [T, heads, 2, D/2]
    a, b = halves[..., 0, :], halves[..., 1, :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)
