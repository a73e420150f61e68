"""The replay simulator's core: route chunks of trace rows through the dispatch rule and accumulate the
traffic and balance metrics of docs/design.md ("Metrics"). numpy in, counters out.

Shape legend: T rows (tokens) in a chunk, L MoE layers, K top-k, R ranks, N nodes, G GPUs per node.
    expert_ids [T, L, K] int (-1 = none)   src [T] rank where each token's request runs
    position   [T] the token's 0-based position in its request
    step       [T] optional replay step of each row, non-decreasing over all rows fed

Definitions (a "pair" is one (token, layer, k) with an expert id other than -1):
  inter-node, deduplicated: per (token, layer), the number of distinct nodes other than the token's own
      among its destinations; times the bytes of one row there and back (`bytes_per_send`:
      `2 * hidden * dtype_bytes` in the model's dtype; a dispatch or combine format counts its packed
      row instead, kernels/formats.py payload_row_bytes, as the serving exchange does);
  inter-node, not deduplicated: pairs whose destination is on another node;
  intra-node, deduplicated: the tier-2 payload of the two-tier dispatch (docs/design.md, "Expert-parallel
      serving"): per (token, layer), the number of distinct destination ranks whose local index
      differs from the token's own rank's: the other ranks of its own node, and in each remote node
      the ranks other than the proxy (the rank with the token's local index) that tier 1 sent it to;
  intra-node, not deduplicated: the pairs those tier-2 sends carry;
  locality: share of pairs served on the token's own node (its own rank included);
  expert load of rank r in a layer: pairs it computes; imbalance = max over ranks / mean over ranks;
  attention load: tokens per rank;
  steps: by default consecutive `batch_tokens` rows of the replay order (the last one may be shorter);
      a caller may pass explicit step ids instead (see replay.py's per-rank step order).
All-to-all time, per step and layer (alpha-beta model, two collectives: dispatch and combine):
      t = 2 * latency + max over ranks r of max(inter_r / inter_bw, intra_r / intra_bw)
  where inter_r, intra_r are the deduplicated bytes (both directions) of the tokens whose home is r.
  NVLink and the NICs work concurrently, hence the max of the two rather than the sum; receive-side
  congestion (incast) is not modelled. Totals sum t over steps and layers.
Per-(sender, receiver) rows of both tiers (PairChunk, for the Chakra traces of replay/chakra.py) are
computed only for a meter given a `pair_sink`, from the same masks as the send counts above; the same
rows with each step's pairs per expert slot and its tokens' context lengths (StepChunk, for the decode
step-time model of replay/step_time.py) only for a meter given a `step_sink`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from locus.errors import LocusError
from locus.kernels.formats import payload_row_bytes
from locus.routing.dispatch_rule import DispatchTable, destination_slots, destinations, table_keys
from locus.routing.plan.topology import Topology
from locus.traces.metrics import max_over_mean

if hasattr(np, "bitwise_count"):
    _popcount = np.bitwise_count
else:  # numpy < 2.0: a byte lookup table
    _BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)

    def _popcount(x: np.ndarray) -> np.ndarray:
        b = x[..., None].view(np.uint8)
        return _BYTE_BITS[b].sum(-1, dtype=np.uint8)


@dataclass(frozen=True)
class LinkModel:
    inter_gbps: float = 50.0  # GB/s per GPU between nodes
    intra_gbps: float = 450.0  # GB/s per GPU within a node
    latency_us: float = 5.0  # per all-to-all


@dataclass
class TrafficTotals:
    """Raw sums from a replay; ReplayReport turns them into figures."""

    tokens: int
    steps: int
    valid_pairs: int
    own_rank_pairs: int
    own_node_pairs: int
    inter_node_sends: int  # sum over (token, layer) of distinct remote nodes
    intra_node_sends: int  # sum over (token, layer) of distinct tier-2 destination ranks (own node and proxied)
    intra_node_pairs: int  # pairs carried by tier-2 sends
    bytes_per_send: int  # one row dispatched and combined: 2 * hidden * dtype_bytes in the model's dtype
    layer_loads: np.ndarray  # [L, R] pairs computed per rank
    rank_tokens: np.ndarray  # [R]
    step_expert_imbalance_sum: float  # over steps of the mean over layers
    step_expert_imbalance_count: int
    step_expert_imbalance_worst: float
    step_attention_imbalance_sum: float
    step_attention_imbalance_worst: float
    a2a_seconds: float
    epochs: dict[int, tuple[int, int, int]] | None = None  # per placement epoch: (tokens, inter sends, intra sends)
    # (token, layer) rows by the distinct remote nodes their destinations lie on: [N] (0 .. N - 1 remote nodes)
    remote_nodes: np.ndarray | None = None


@dataclass(frozen=True)
class PairChunk:
    """Rows each rank sends each rank, per step and layer, for one chunk fed to a TrafficMeter: what a
    `pair_sink` receives (only when one is given; the figures above never need it).

    Shape legend: M (step, layer, sender, receiver) entries with at least one row, n steps in the chunk.
        tier1 [M, 5] int64 columns (step, layer, sender, receiver, rows): a token's home rank s sends
              one row to each remote node holding one of its chosen replicas, to that node's proxy
              (the rank with s's local index); counted in inter_node_sends
        tier2 [M, 5] same columns: one row to each distinct destination rank t whose local index
              differs from s's, sent by the rank of t's node that holds the row (s itself on its own
              node, the proxy on a remote one); counted in intra_node_sends
        loads [n, L, R] int64 (token, expert) pairs each rank computes, steps first_step..first_step+n-1
        tokens [n, R] int64 tokens per home rank over the same steps
    Steps are the replay's step ids as fed (explicit ids may leave gaps; a step without tokens is no
    step). Rows are per direction: combine sends the same rows back, receiver to sender.
    """

    first_step: int
    tier1: np.ndarray
    tier2: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray


PairSink = Callable[[PairChunk], None]


@dataclass(frozen=True)
class StepChunk:
    """What the decode step-time model needs of one chunk fed to a TrafficMeter (only with a `step_sink`).

    Shape legend: n steps in the chunk (first_step .. first_step + n - 1), R ranks, M entries.
        pairs     the chunk's PairChunk (rows per step, layer, sender and receiver of both tiers)
        slots     [M, 4] int64 columns (step, layer, physical slot, pairs): the (token, k) pairs each
                  expert slot computes (slot // slots_per_gpu is its rank); steps absolute
        contexts  [n, R] int64 the context each home rank's rows attend over: sum of position + 1
        decode    [n] int64 rows that decode (position at or past their request's prompt)
    A step may continue in the next chunk: a sink sums what two chunks give for the same step.
    """

    first_step: int
    pairs: PairChunk
    slots: np.ndarray
    contexts: np.ndarray
    decode: np.ndarray


StepSink = Callable[[StepChunk], None]


def _pair_counts(keys: np.ndarray, first_step: int, L: int, R: int) -> np.ndarray:
    """Flat keys ((step * L + layer) * R + sender) * R + receiver, one per row -> [M, 5] counts."""
    keys, rows = np.unique(keys, return_counts=True)
    receiver, keys = keys % R, keys // R
    sender, keys = keys % R, keys // R
    return np.stack([keys // L + first_step, keys % L, sender, receiver, rows], axis=1).astype(np.int64)


def _bit_dtype(bits: int) -> type:
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if bits <= np.dtype(dtype).itemsize * 8:
            return dtype
    raise LocusError(f"replay counts distinct nodes and ranks in 64-bit masks; {bits} is too many")


class TrafficMeter:
    """Accumulates metrics over chunks fed in replay order; `add` any number of rows at a time."""

    def __init__(self, table: DispatchTable, topology: Topology, hidden_size: int, dtype_bytes: int,
                 batch_tokens: int, links: LinkModel = LinkModel(), pair_sink: PairSink | None = None,
                 epoch_tables: dict[int, DispatchTable] | None = None, dispatch_format: str = "model",
                 combine_format: str = "model", step_sink: StepSink | None = None):
        """epoch_tables: one table per placement epoch (same topology); `add` then routes each row by
        the table of its epoch (a trace recorded across a live re-plan). dispatch_format / combine_format:
        what a row travels in each way (formats.PAYLOAD_FORMATS; --ep-dispatch-format of the server).
        step_sink: receives a StepChunk per chunk (the step-time model's input); `add` then wants `decode`."""
        if batch_tokens < 1:
            raise LocusError(f"batch_tokens must be at least 1, got {batch_tokens}")
        self.table, self.batch_tokens, self.links = table, int(batch_tokens), links
        self.epoch_tables = epoch_tables
        self.epoch_sums: dict[int, np.ndarray] = {}  # epoch -> [tokens, inter sends, intra sends]
        self.pair_sink = pair_sink  # optional: per-(sender, receiver) rows, see PairChunk
        self.step_sink = step_sink  # optional: StepChunk, for the step-time model
        self.slots_per_gpu = topology.slots_per_gpu
        self.dispatch_bytes = payload_row_bytes(int(hidden_size), dispatch_format, int(dtype_bytes))
        self.combine_bytes = payload_row_bytes(int(hidden_size), combine_format, int(dtype_bytes))
        self.bytes_per_send = self.dispatch_bytes + self.combine_bytes
        R, L, G = topology.ranks, table.num_layers, topology.gpus_per_node
        self.R, self.L, self.G = R, L, G
        rank = np.arange(R + 1)
        node = rank // G
        self.node_of = np.where(rank < R, node, -1).astype(np.int16)  # [R + 1], -1 for "no expert"
        node_dtype, local_dtype = _bit_dtype(topology.nodes), _bit_dtype(G)
        self.node_bit = np.where(rank < R, np.left_shift(1, node % 64), 0).astype(node_dtype)
        self.local_bit = np.where(rank < R, np.left_shift(1, rank % G), 0).astype(local_dtype)
        self.rows = 0
        self.counts = np.zeros(5, dtype=np.int64)  # own_rank, own_node, inter sends, intra sends, intra pairs
        self.none_pairs = 0
        self.remote_nodes = np.zeros(topology.nodes, dtype=np.int64)
        self.layer_loads = np.zeros((L, R), dtype=np.int64)
        self.rank_tokens = np.zeros(R, dtype=np.int64)
        self.open = None  # the step still being filled: (loads [L, R], inter [L, R], intra [L, R], tokens [R])
        self.open_step = -1
        self.steps = 0
        self.imb_sum, self.imb_count, self.imb_worst = 0.0, 0, float("nan")
        self.attn_sum, self.attn_worst = 0.0, float("nan")
        self.a2a_seconds = 0.0

    def add(self, expert_ids: np.ndarray, src: np.ndarray, position: np.ndarray, step=None,
            epochs: np.ndarray | None = None, decode: np.ndarray | None = None) -> None:
        """decode [T] bool, only with a step sink: the rows at or past their request's prompt."""
        T, L, K = expert_ids.shape
        if L != self.L:
            raise LocusError(f"trace rows have {L} MoE layers, the plan has {self.L}")
        if T == 0:
            return
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < -1 or hi >= self.table.num_experts:
            bad = lo if lo < -1 else hi
            raise LocusError(f"trace expert id {bad} is outside -1..{self.table.num_experts - 1}")
        R, B = self.R, self.batch_tokens
        step = (self.rows + np.arange(T)) // B if step is None else np.asarray(step, dtype=np.int64)
        first = int(step[0])
        if first < self.open_step or (np.diff(step) < 0).any():
            raise ValueError("replay steps must not decrease")
        step = step - first  # [T]
        n = int(step[-1]) + 1
        src = np.asarray(src, dtype=np.int64)
        dest = self._destinations(expert_ids, src, np.asarray(position), epochs)  # [T, L, K]

        own_node = self.node_of[dest] == self.node_of[src][:, None, None]
        own_rank = dest == src[:, None, None].astype(dest.dtype)
        remote_nodes = np.bitwise_or.reduce(self.node_bit[dest], axis=2) & ~self.node_bit[src][:, None]
        # tier 2 reaches every destination whose local index differs from the source's: the source
        # itself and the remote proxies (same local index) hold the row already
        tier2 = (dest < R) & ((dest % self.G) != (src % self.G)[:, None, None])  # [T, L, K]
        ranks = np.sort(np.where(tier2, dest, R), axis=2)
        distinct = np.ones(ranks.shape, dtype=bool)
        distinct[..., 1:] = ranks[..., 1:] != ranks[..., :-1]
        inter = _popcount(remote_nodes)  # [T, L] distinct remote nodes
        intra = np.count_nonzero(distinct & (ranks < R), axis=2)  # [T, L] distinct tier-2 destinations
        self.remote_nodes += np.bincount(inter.ravel(), minlength=len(self.remote_nodes))
        self.counts += (np.count_nonzero(own_rank), np.count_nonzero(own_node),
                        int(inter.sum(dtype=np.int64)), int(intra.sum(dtype=np.int64)), np.count_nonzero(tier2))
        if self.epoch_tables is not None and epochs is not None:
            for epoch in np.unique(epochs):
                rows = np.asarray(epochs) == epoch
                sums = self.epoch_sums.setdefault(int(epoch), np.zeros(3, dtype=np.int64))
                sums += (int(rows.sum()), int(inter[rows].sum(dtype=np.int64)), int(intra[rows].sum(dtype=np.int64)))

        # Per-step sums, indexed by the step relative to the chunk's first one.
        row_key = step[:, None] * L + np.arange(L)  # [T, L]
        load_key = (row_key * (R + 1)).astype(np.int32)[:, :, None] + dest
        loads = np.bincount(load_key.ravel(), minlength=n * L * (R + 1)).reshape(n, L, R + 1)
        self.none_pairs += int(loads[..., R].sum())
        loads = loads[..., :R]
        send_key = (row_key * R + src[:, None]).ravel()
        inter_r = np.bincount(send_key, weights=inter.ravel(), minlength=n * L * R).reshape(n, L, R)
        intra_r = np.bincount(send_key, weights=intra.ravel(), minlength=n * L * R).reshape(n, L, R)
        tokens = np.bincount(step * R + src, minlength=n * R).reshape(n, R)
        self.layer_loads += loads.sum(0)
        self.rank_tokens += tokens.sum(0)
        if self.pair_sink is not None or self.step_sink is not None:
            tier2_dest = distinct & (ranks < R)  # [T, L, K] each tier-2 destination once
            # copies: the open-step merge below adds into loads[0] and tokens[0] in place
            pairs = self._pair_chunk(first, step, src, remote_nodes, ranks, tier2_dest, loads.copy(), tokens.copy())
            if self.pair_sink is not None:
                self.pair_sink(pairs)
            if self.step_sink is not None:
                self.step_sink(self._step_chunk(first, n, step, expert_ids, src, np.asarray(position), epochs, decode,
                                                pairs))

        if self.open is not None:
            if first == self.open_step:  # the chunk's first step continues the step left open
                for acc, part in zip(self.open, (loads, inter_r, intra_r, tokens)):
                    part[0] += acc
            else:
                self._close_steps(*(x[None] for x in self.open))
        self.rows += T
        # The chunk's last step stays open: the next chunk may continue it.
        self._close_steps(loads[:-1], inter_r[:-1], intra_r[:-1], tokens[:-1])
        self.open = (loads[-1].copy(), inter_r[-1].copy(), intra_r[-1].copy(), tokens[-1].copy())
        self.open_step = first + n - 1

    def _destinations(self, expert_ids: np.ndarray, src: np.ndarray, position: np.ndarray,
                      epochs: np.ndarray | None) -> np.ndarray:
        """Destination rank of every (row, layer, k): by the one table, or by each row's epoch's."""
        if self.epoch_tables is None or epochs is None:
            return destinations(self.table, table_keys(self.table, expert_ids, src), position)
        epochs = np.asarray(epochs)
        dest = np.empty(expert_ids.shape, dtype=np.int16)
        for epoch in np.unique(epochs):
            table = self.epoch_tables.get(int(epoch))
            if table is None:
                raise LocusError(f"the trace has rows of placement epoch {int(epoch)}, and no plan for it")
            rows = epochs == epoch
            dest[rows] = destinations(table, table_keys(table, expert_ids[rows], src[rows]), position[rows])
        return dest

    def _step_chunk(self, first: int, n: int, step: np.ndarray, expert_ids: np.ndarray, src: np.ndarray,
                    position: np.ndarray, epochs, decode, pairs: PairChunk) -> StepChunk:
        """The chunk's StepChunk: pairs per expert slot (the dispatch rule's own slot choice), contexts, decode rows.

        step [T] relative to `first`; the other arrays as `add` takes them."""
        if decode is None:
            raise ValueError("a meter with a step sink needs each row's decode flag")
        R, L = self.R, self.L
        slots = np.empty(expert_ids.shape, dtype=np.int64)
        for table, rows in self._tables_by_epoch(epochs, len(src)):
            keys = table_keys(table, expert_ids[rows], src[rows])
            slots[rows] = destination_slots(table, keys, position[rows])
        P = R * self.slots_per_gpu
        key = ((step[:, None, None] * L + np.arange(L)[None, :, None]) * P + slots)[slots >= 0]
        key, count = np.unique(key, return_counts=True)
        slot_rows = np.stack([key // (L * P) + first, (key // P) % L, key % P, count], axis=1).astype(np.int64)
        home = step * R + src
        contexts = np.bincount(home, weights=position + 1, minlength=n * R).reshape(n, R).astype(np.int64)
        decoding = np.bincount(step, weights=np.asarray(decode, dtype=np.int64), minlength=n).astype(np.int64)
        return StepChunk(first, pairs, slot_rows, contexts, decoding)

    def _tables_by_epoch(self, epochs, T: int):
        """(table, row mask) for the rows of each epoch: the one table for all rows without epochs."""
        if self.epoch_tables is None or epochs is None:
            return [(self.table, np.ones(T, dtype=bool))]
        epochs = np.asarray(epochs)
        return [(self.epoch_tables[int(e)], epochs == e) for e in np.unique(epochs)]

    def _pair_chunk(self, first: int, step: np.ndarray, src: np.ndarray, remote_nodes: np.ndarray,
                    ranks: np.ndarray, tier2_dest: np.ndarray, loads: np.ndarray, tokens: np.ndarray) -> PairChunk:
        """The chunk's rows per (step, layer, sender, receiver), by the same rules as the send counts.

        step [T] relative to `first`, remote_nodes [T, L] bitmask, ranks [T, L, K] sorted destinations
        (R = none), tier2_dest [T, L, K] marks each distinct tier-2 destination in `ranks`.
        """
        R, L, G = self.R, self.L, self.G
        step_layer = (step[:, None] * L + np.arange(L)) * R  # [T, L] key prefix of (step, layer)
        local = src % G
        # tier 1: one row to each remote node in the token's mask, to that node's proxy
        tier1 = []
        for node in range(R // G):
            hit = (remote_nodes & self.node_bit[node * G]) != 0  # [T, L]
            tier1.append(((step_layer + src[:, None]) * R + (node * G + local)[:, None])[hit])
        # tier 2: the sender is the rank of the destination's node with the source's local index
        dest = ranks.astype(np.int64)  # [T, L, K]
        sender = (dest // G) * G + local[:, None, None]
        tier2 = ((step_layer[:, :, None] + sender) * R + dest)[tier2_dest]
        return PairChunk(first, _pair_counts(np.concatenate(tier1), first, L, R),
                         _pair_counts(tier2, first, L, R), loads, tokens)

    def _close_steps(self, loads, inter, intra, tokens) -> None:
        """Fold finished steps ([n, L, R] sums, tokens [n, R]) into the step statistics."""
        busy = tokens.sum(-1) > 0  # explicit step ids may leave gaps: an empty step is no step
        loads, inter, intra, tokens = loads[busy], inter[busy], intra[busy], tokens[busy]
        if len(loads) == 0:
            return
        self.steps += len(loads)
        imbalance = max_over_mean(loads, np.nan)  # [n, L]; nan: layer idle
        defined = imbalance[~np.isnan(imbalance).all(1)]
        if len(defined):
            self.imb_sum += float(np.nanmean(defined, axis=1).sum())
            self.imb_count += len(defined)
            self.imb_worst = float(np.nanmax([self.imb_worst, np.nanmax(defined)]))
        attn = max_over_mean(tokens)  # every step has at least one token
        self.attn_sum += float(attn.sum())
        self.attn_worst = float(np.nanmax([self.attn_worst, attn.max()]))
        u, links = self.bytes_per_send, self.links
        busy = np.maximum(inter * (u / (links.inter_gbps * 1e9)), intra * (u / (links.intra_gbps * 1e9)))
        self.a2a_seconds += float(busy.max(-1).sum()) + loads.shape[0] * loads.shape[1] * 2 * links.latency_us * 1e-6

    def finish(self) -> TrafficTotals:
        """Close the last (possibly short) step and return the sums."""
        if self.open is not None:
            self._close_steps(*(x[None] for x in self.open))
            self.open = None
        valid = int(self.layer_loads.sum())
        own_rank, own_node, inter, intra, intra_pairs = (int(x) for x in self.counts)
        return TrafficTotals(
            tokens=self.rows,
            steps=self.steps,
            valid_pairs=valid,
            own_rank_pairs=own_rank,
            own_node_pairs=own_node,
            inter_node_sends=inter,
            intra_node_sends=intra,
            intra_node_pairs=intra_pairs,
            bytes_per_send=self.bytes_per_send,
            epochs={e: tuple(int(x) for x in s) for e, s in sorted(self.epoch_sums.items())} if self.epoch_tables else None,
            remote_nodes=self.remote_nodes.copy(),
            layer_loads=self.layer_loads.copy(),
            rank_tokens=self.rank_tokens.copy(),
            step_expert_imbalance_sum=self.imb_sum,
            step_expert_imbalance_count=self.imb_count,
            step_expert_imbalance_worst=self.imb_worst,
            step_attention_imbalance_sum=self.attn_sum,
            step_attention_imbalance_worst=self.attn_worst,
            a2a_seconds=self.a2a_seconds,
        )
