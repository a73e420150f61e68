"""How an exchanged row's values travel: in the model's dtype, or quantized to an MX format
(`--ep-dispatch-format` / `--ep-combine-format`, docs/formats.md "Dispatch payloads").

A quantized row of H values is its H one-byte elements followed by its ceil(H/32) E8M0 scale
bytes (scales along the hidden dimension, one per 32 consecutive values), sent as bytes and
dequantized to the model's dtype on arrival. On CPU both directions are one C pass per row
(kernels/mx_rows_cpu.py), bit-exact with the torch ops they replace (still used on GPU). In the model's dtype a row is its values' own bytes
(a view, no copy). `Payload.nbytes` is what the byte counters and the replay count for one row.

Shape legend: N rows, H hidden, B = nbytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from locus.kernels import mx_rows_cpu
from locus.kernels.formats import FORMATS, QuantizedTensor, payload_row_bytes, quantize


@dataclass(frozen=True)
class Payload:
    hidden: int
    dtype: torch.dtype  # the model's (what a row is computed in, and decoded to)
    format: str = "model"  # formats.PAYLOAD_FORMATS
    nbytes: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "nbytes", payload_row_bytes(self.hidden, self.format, self.dtype.itemsize))

    @property
    def quantized(self) -> bool:
        return self.format != "model"

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, H] in the model's dtype -> [N, B] uint8."""
        if x.shape[0] == 0:  # (an empty tensor may carry strides a byte view refuses)
            return torch.empty((0, self.nbytes), dtype=torch.uint8, device=x.device)
        if not self.quantized:
            return x.contiguous().view(torch.uint8)
        if mx_rows_cpu.encode_applies(x, self.format):  # same bytes, one C pass
            return mx_rows_cpu.encode_rows(x, self.format)
        q = quantize(x, self.format, axis=1)
        return torch.cat([q.data.view(torch.uint8), q.scale], dim=1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """[N, B] uint8 (a view into wider rows is fine) -> [N, H] in the model's dtype."""
        if not self.quantized:
            return rows.view(self.dtype)
        H = self.hidden
        if rows.shape[0] == 0:
            return torch.empty((0, H), dtype=self.dtype, device=rows.device)
        if mx_rows_cpu.decode_applies(rows, self.format, self.dtype):  # same values, one C pass
            return mx_rows_cpu.decode_rows(rows, self.format, H, self.dtype)
        element = FORMATS[self.format].element.torch_dtype
        q = QuantizedTensor(rows[:, :H].view(element), rows[:, H:self.nbytes], self.format, (rows.shape[0], H), 1)
        return q.dequantize(self.dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What a row of x reads on arrival (x itself in the model's dtype)."""
        return self.decode(self.encode(x)) if self.quantized else x


def simulate_dispatch(model, fmt: str | None) -> None:
    """Make a one-process model compute its routed experts on rows rounded to `fmt`, as every expert
    of an expert-parallel run with `--ep-dispatch-format fmt` does (None or "model": as they are)."""
    from locus.engine.model.moe import RoutedMoE

    for module in model.modules():
        if isinstance(module, RoutedMoE):
            module.dispatch_format = None if fmt in (None, "model") else fmt
