"""A step's small inputs to the device and its results back, without making the host wait.

On a GPU, `torch.tensor(values, device="cuda")` and `tensor.tolist()` each block the host until the
device has caught up (a copy from pageable memory, a read of a value not computed yet). A decode
step built of such calls keeps the host and the device taking turns. Here:
- host values travel as numpy arrays (or CPU tensors) through pinned memory with a non-blocking
  copy (`to_device`), queued behind the device's work, not waiting for it;
- a step's results (sampled ids, the logprobs asked for, routing) come back in ONE non-blocking copy
  into pinned memory followed by one event (`Readback`): the host waits only when it reads them, which
  the overlapped schedule does while the device runs the next step (core/launched_step.py).
On CPU there is nothing to wait for: `to_device` wraps the array, and a readback snapshots the tensors.
"""

from __future__ import annotations

import time

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.float64: np.float64}


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device`, copied without blocking the host (CUDA: through pinned
    memory, queued on the current stream). The array must not change afterwards (on CPU it is shared)."""
    host = values if isinstance(values, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class Readback:
    """Device tensors that come back to the host together: `add` them, `issue` the copy (no wait),
    `wait` for the host arrays. Supports int64, int32, float32 and float64 tensors."""

    def __init__(self, device: torch.device):
        self.device = device
        self._parts: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None  # pinned bytes (CUDA)
        self._layout: list[tuple[int, np.dtype, tuple[int, ...]]] = []  # per part: offset, dtype, shape
        self._event = None
        self._arrays: list[np.ndarray] | None = None
        self.wait_seconds = 0.0  # how long `wait` blocked (the device was still busy)

    def add(self, tensor: torch.Tensor) -> int:
        """Queue one tensor; returns its index in `wait()`'s list."""
        if tensor.dtype not in _NUMPY:
            raise TypeError(f"a readback takes {', '.join(map(str, _NUMPY))} tensors, not {tensor.dtype}")
        self._parts.append(tensor.detach())
        return len(self._parts) - 1

    def issue(self) -> None:
        """Start the copy (CUDA: one device-side concatenation of the parts' bytes, one non-blocking
        copy into pinned memory, one event). Nothing is read here."""
        if not self._parts:
            return
        if self.device.type == "cpu":  # the values as of now, as a device's copy would hold them (a later
            self._parts = [p.clone() for p in self._parts]  # step may reuse a static output buffer)
            return
        # widest elements first: every part then starts at an offset its element size divides
        order = sorted(range(len(self._parts)), key=lambda i: -self._parts[i].element_size())
        pieces, offset = [], 0
        self._layout = [None] * len(self._parts)  # type: ignore[list-item]
        for i in order:
            part = self._parts[i]
            pieces.append(part.contiguous().view(-1).view(torch.uint8))
            self._layout[i] = (offset, np.dtype(_NUMPY[part.dtype]), tuple(part.shape))
            offset += part.numel() * part.element_size()
        packed = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        pinned = self.device.type == "cuda"
        self._host = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=pinned)
        self._host.copy_(packed, non_blocking=pinned)
        if pinned:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> list[np.ndarray]:
        """The parts as host arrays, in the order they were added (waits for the copy once)."""
        if self._arrays is not None:
            return self._arrays
        start = time.perf_counter()
        if self.device.type == "cpu":
            self._arrays = [p.numpy() for p in self._parts]
        elif not self._parts:
            self._arrays = []
        else:
            if self._event is not None:
                self._event.synchronize()
            data = self._host.numpy()
            self._arrays = [np.frombuffer(data, dtype, int(np.prod(shape)), offset).reshape(shape)
                            for offset, dtype, shape in self._layout]
        self.wait_seconds = time.perf_counter() - start
        self._parts = []  # the device tensors may go
        return self._arrays
