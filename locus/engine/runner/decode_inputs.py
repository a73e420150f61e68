"""The decode graphs' static inputs: device buffers at fixed addresses, refilled every step.

A captured CUDA graph replays the kernels it recorded on the tensors it recorded, so a decode step
cannot hand it new tensors: it writes the step's values into the same buffers. The host writes them
with numpy into a staging area (pinned memory on CUDA), and ONE non-blocking copy moves the step's
part to the device; a device-side copy then puts the step's block tables in place. On CPU the
staging area is the buffers themselves.

Layout (int32; the model casts what must be int64 once per forward):
    meta   [5, B_max]        0 token ids | 1 positions (-1 = padding) | 2 KV write rows | 3 context lengths
                             | 4 feed source: the row of the previous step's sampled ids that is this
                               row's token (-1: the host's token id); see `feed`
    tables [B_max, W_max]    block ids; W_max = the most blocks a sequence can hold
The staged tables are dense [B, W] for the step's widest table W, so a step copies B * W entries,
not B * W_max. Columns of `tables` past a row's W keep stale (valid) block ids: the paged kernel
never reads past a context, and the gathered path reads only the step's [B, W], scratch-padded.

Two staging areas alternate, so the host fills step N + 1's while step N's copy may still be in
flight; before reusing one it waits for the copy that last read it (step N - 1's).

The overlapped schedule (core/launched_step.py) stages step N + 1 before step N's tokens reach the host: a
sequence's newest token is then staged as a placeholder with its feed source, and `feed` copies it
from step N's sampled ids on the device after the commit, before the graph reads the buffers.

Shape legend: B bucket, n real sequences, W widest table of the step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

MIN_TABLE_WIDTH = 2  # dynamo specialises a dynamic dimension of size 0 or 1; never pass one
META_ROWS = 5


@dataclass
class DecodeArgs:
    """The tensors one bucket's graph runs on (views of the static buffers)."""

    input_ids: torch.Tensor  # [B] int32
    positions: torch.Tensor  # [B] int32
    write_rows: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32 (W = W_max when the graph reads tables in place)

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.positions, self.write_rows, self.context_lens, self.block_tables


class DecodeInputs:
    def __init__(self, max_batch: int, max_width: int, block_size: int, scratch_block: int,
                 device: torch.device, staged: bool | None = None):
        """staged: write a staging area and copy it over (default: on any device but the CPU; a test
        may stage on CPU too, to run that path without a GPU)."""
        self.max_batch, self.max_width = max_batch, max(max_width, MIN_TABLE_WIDTH)
        self.block_size, self.scratch_block, self.device = block_size, scratch_block, device
        self.staged = device.type != "cpu" if staged is None else staged
        on_cuda = device.type == "cuda"
        meta_size = META_ROWS * max_batch
        if self.staged:
            # device: [meta | dense tables of the step]; the graphs read meta in place, tables after a copy
            self._flat = torch.zeros(meta_size + max_batch * self.max_width, dtype=torch.int32, device=device)
            self.meta = self._flat[:meta_size].view(META_ROWS, max_batch)
            self._staging = [torch.zeros(self._flat.numel(), dtype=torch.int32, pin_memory=on_cuda) for _ in range(2)]
            self._staging_np = [area.numpy() for area in self._staging]  # the host writes these
            # the copy that last read each staging area (CUDA copies are asynchronous; others are done at once)
            self._copied: list[torch.cuda.Event | None] = [None, None]
            self._track_copies = on_cuda
            self._turn = 0
        else:
            self.meta = torch.zeros(META_ROWS, max_batch, dtype=torch.int32)
        self.tables = torch.full((max_batch, self.max_width), scratch_block, dtype=torch.int32, device=device)
        if not self.staged:  # the host writes the buffers themselves
            self._meta_np, self._tables_np = self.meta.numpy(), self.tables.numpy()
        self._views: dict[int, DecodeArgs] = {}  # per bucket, at the whole table width

    def args(self, B: int, width: int | None = None) -> DecodeArgs:
        """Bucket B's views; `width` None = the whole table width (paged attention)."""
        whole = self._views.get(B)
        if whole is None:
            m = self.meta
            whole = self._views[B] = DecodeArgs(m[0, :B], m[1, :B], m[2, :B], m[3, :B], self.tables[:B])
        if width is None:
            return whole
        return DecodeArgs(whole.input_ids, whole.positions, whole.write_rows, whole.context_lens,
                          self.tables[:B, :width])

    def stage(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], B: int,
              sources: list[int] | None = None) -> int:
        """Write a step of n <= B sequences (and B - n padding rows); returns the widest table W.
        sources: per sequence, the row of the previous step's sampled ids that is its token (-1: the
        token id given here), for `feed`."""
        n = len(token_ids)
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)
        W = max(MIN_TABLE_WIDTH, int(lengths.max()) if n else 0)
        if W > self.max_width:
            raise ValueError(f"a block table of {W} blocks exceeds the decode graphs' width {self.max_width}")
        meta, tables = self._host_views(B, W)
        bs, scratch_row = self.block_size, self.scratch_block * self.block_size
        tables.fill(self.scratch_block)
        if n:
            flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(lengths.sum()))
            starts = np.cumsum(lengths) - lengths
            seq = np.repeat(np.arange(n), lengths)
            tables[seq, np.arange(flat.size) - starts[seq]] = flat
        pos = np.asarray(positions, dtype=np.int64)
        meta[0, :n] = token_ids
        meta[1, :n] = pos
        meta[2, :n] = tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        meta[3, :n] = pos + 1
        meta[4, :n] = -1 if sources is None else sources
        meta[0, n:B], meta[1, n:B], meta[2, n:B], meta[3, n:B], meta[4, n:B] = 0, -1, scratch_row, 0, -1
        self.width = W
        return W

    def stage_padding(self, B: int) -> None:
        """A step of B padding rows (graph warm-up and capture)."""
        self.stage([], [], [], B)

    def commit(self, B: int) -> None:
        """Make the staged step the device's (CUDA: one host-to-device copy, then the tables' copy;
        both queued on the current stream, ahead of the graph that reads them)."""
        if not self.staged:
            return
        W, meta_size = self.width, self.meta.numel()
        used = meta_size + B * W
        self._flat[:used].copy_(self._staging[self._turn][:used], non_blocking=True)
        self.tables[:B, :W].copy_(self._flat[meta_size:used].view(B, W))
        if self._track_copies:
            event = self._copied[self._turn] = self._copied[self._turn] or torch.cuda.Event()
            event.record()
        self._turn ^= 1

    def feed(self, n: int, tokens: torch.Tensor) -> None:
        """After `commit`: the staged rows with a feed source take their token from `tokens` (the
        previous step's sampled ids, on the device), the others keep theirs. Device ops only."""
        source = self.meta[4, :n]
        ids = self.meta[0, :n]
        fed = tokens.index_select(0, source.clamp(min=0)).to(torch.int32)
        ids.copy_(torch.where(source >= 0, fed, ids))

    def _host_views(self, B: int, W: int) -> tuple[np.ndarray, np.ndarray]:
        """(meta [5, B_max], tables [B, W]) numpy views the host writes."""
        if not self.staged:
            return self._meta_np, self._tables_np[:B, :W]
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()  # the copy that last read this staging area is done
        staging = self._staging_np[self._turn]
        meta_size = self.meta.numel()
        return staging[:meta_size].reshape(META_ROWS, self.max_batch), staging[meta_size:meta_size + B * W].reshape(B, W)
