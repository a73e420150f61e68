"""The decode step-time model: what each replay step would take on a hardware profile, from the same
routing the byte figures count (the serving runtime's dispatch rule, through TrafficMeter's StepChunk).

Per replay step, per MoE layer l and rank r (docs/design.md, "Metrics", "Predicted step time"):
  attention[r]   its rows' KV cache read at memory bandwidth (context = position + 1 tokens of
                 kv_bytes_per_token each), plus the dense work: every non-expert weight (attention
                 projections, dense and shared FFNs, routers, lm_head) read once, or its rows' FLOPs at
                 tensor peak, whichever is longer; a rank without rows does none. Spread evenly over the
                 MoE layers (each stands for the decoder layers up to it).
  experts[l, r]  per expert slot of r its tokens reach: the expert's weights at memory bandwidth or its
                 tokens' FLOPs at tensor peak, whichever is longer, over the kernels' measured efficiency
                 at that many tokens per expert; plus the kernels' floor once any slot of r runs.
  exchange[l]    per direction (dispatch, combine): the collective's latency, plus the longest of every
                 unit's (a rank, or a node where the profile's link is the node's) inter-node and
                 intra-node bytes, the larger of sent and received, at that tier's bandwidth. A unit's
                 bytes: the rows it sends or receives (the payload format's row each), a message's wire
                 overhead for each (sender, receiver) pair with rows, and the collective's own bytes.
  step           overhead + control-plane bytes at the inter-node bandwidth + sum over l of
                 (max over r of attention + experts) + dispatch + combine.
With the profile's host_overlap "per_collective" the same parts compose otherwise: the step's
collectives (the control plane's, then each layer's dispatch and combine) each run under the host
work before them and cost the longer of the two. The host work before a collective: the overhead
spread evenly over the step's 1 + 2L collectives, plus the longest rank's attention share (before a
dispatch) or the longest rank's experts of the layer (before its combine), since a collective waits
for every rank:
  step           max(o, control) + sum over l of max(o + max_r attention / L, dispatch_l)
                 + max(o + max_r experts[l, r], combine_l),   o = overhead / (1 + 2L);
its split reports the serial parts and `overlap`, the difference (negative: saved).
With two-batch overlap a step's rows split in two micro-batches (lanes a and b; a slot's tokens and a
rank's rows halved, ceil to a): per layer c_a + max(x_a, c_b) + x_b, c the slowest rank's compute of a
lane (each lane reads the weights its tokens touch) and x a lane's exchange (latency, half the rows,
every message). Its split reports the serial parts and `overlap`, the difference (negative: saved).

Shape legend: m steps being closed, L MoE layers, R ranks, S slots per rank, P = R * S slots, U units.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.topology import Topology
from locus.routing.replay.hardware import HardwareProfile, Link
from locus.routing.replay.metrics import StepChunk
from locus.routing.replay.model_shape import ModelShape

PARTS = ("attention", "experts", "exchange", "overhead", "overlap")


@dataclass(frozen=True)
class StepTimes:
    """Every replay step's predicted time and its split, in seconds; `decode` marks the steps that
    decode (TPOT's steps: a step with no decoding row is a prefill's, TTFT's)."""

    seconds: np.ndarray  # [steps]
    parts: dict  # part -> [steps]
    decode: np.ndarray  # [steps] bool

    def summary(self) -> dict:
        """TPOT p50 / p99 over the decode steps (all steps when none decodes) and each part's mean, ms."""
        pick = self.decode if self.decode.any() else np.ones(len(self.seconds), dtype=bool)
        times = self.seconds[pick]
        if len(times) == 0:
            return {"steps": 0, "tpot_p50_ms": float("nan"), "tpot_p99_ms": float("nan"),
                    "split_ms": {p: float("nan") for p in PARTS}}
        return {"steps": int(len(times)), "tpot_p50_ms": 1e3 * float(np.percentile(times, 50)),
                "tpot_p99_ms": 1e3 * float(np.percentile(times, 99)),
                "split_ms": {p: 1e3 * float(self.parts[p][pick].mean()) for p in PARTS}}


class StepTimeModel:
    """A TrafficMeter step sink: call it with every StepChunk in replay order, then `finish()`."""

    def __init__(self, shape: ModelShape, hardware: HardwareProfile, topology: Topology, num_layers: int,
                 dispatch_row_bytes: int, combine_row_bytes: int, two_batch_overlap: bool = False):
        if two_batch_overlap and hardware.host_overlap != "none":
            raise LocusError(f"hardware profile {hardware.name}: two-batch overlap is modelled on a profile whose "
                             f"host_overlap is 'none' only (this one's is {hardware.host_overlap!r})")
        self.shape, self.hw, self.topology = shape, hardware, topology
        self.R, self.G, self.S, self.L = topology.ranks, topology.gpus_per_node, topology.slots_per_gpu, num_layers
        self.row_bytes = {"dispatch": int(dispatch_row_bytes), "combine": int(combine_row_bytes)}
        self.overlap = bool(two_batch_overlap)
        R = self.R
        self.latency = {"dispatch": hardware.dispatch_latency_s.at(R), "combine": hardware.combine_latency_s.at(R)}
        self.pending = None  # the steps not yet closed: [first, tokens, contexts, decode, slots, tier1, tier2]
        self.out: list[tuple[np.ndarray, dict, np.ndarray]] = []

    def __call__(self, chunk: StepChunk) -> None:
        n = chunk.contexts.shape[0]
        new = [chunk.first_step, chunk.pairs.tokens.astype(np.int64), chunk.contexts, chunk.decode, chunk.slots,
               chunk.pairs.tier1, chunk.pairs.tier2]
        if self.pending is None:
            self.pending = new
        else:
            first = self.pending[0]
            gap = chunk.first_step - first  # the chunk's first step, relative to the pending ones
            for i in (1, 2, 3):
                grown = np.zeros((gap + n,) + new[i].shape[1:], dtype=np.int64)
                grown[: len(self.pending[i])] += self.pending[i]
                grown[gap:] += new[i]
                self.pending[i] = grown
            for i in (4, 5, 6):
                self.pending[i] = np.concatenate([self.pending[i], new[i]])
        last = chunk.first_step + n - 1  # may continue in the next chunk
        self._close(before=last)

    def finish(self) -> StepTimes:
        if self.pending is not None:
            self._close(before=None)
        if not self.out:
            return StepTimes(np.zeros(0), {p: np.zeros(0) for p in PARTS}, np.zeros(0, dtype=bool))
        return StepTimes(np.concatenate([o[0] for o in self.out]),
                         {p: np.concatenate([o[1][p] for o in self.out]) for p in PARTS},
                         np.concatenate([o[2] for o in self.out]))

    def _close(self, before: int | None) -> None:
        """Time every pending step before step `before` (all of them when None) and drop it."""
        first, tokens, contexts, decode, slots, tier1, tier2 = self.pending
        m = len(tokens) if before is None else before - first
        if m <= 0:
            return
        done = lambda rows: rows[:, 0] < first + m  # noqa: E731
        keep = [first + m, tokens[m:], contexts[m:], decode[m:]] + [x[~done(x)] for x in (slots, tier1, tier2)]
        part = [x[done(x)] for x in (slots, tier1, tier2)]
        # a step that two chunks fed has its (sender, receiver) entries twice: one message each
        part[1:] = [_merge_rows(x, self.L, self.R) for x in part[1:]]
        busy = tokens[:m].sum(1) > 0  # explicit step ids may leave gaps: a step without rows is no step
        if busy.any():
            seconds, parts = self._time(first, m, tokens[:m], contexts[:m], *part)
            self.out.append((seconds[busy], {p: v[busy] for p, v in parts.items()}, decode[:m][busy] > 0))
        self.pending = None if before is None else keep

    # -- the model ---------------------------------------------------------------------------------
    def _time(self, first: int, m: int, tokens, contexts, slots, tier1, tier2):
        L = self.L
        attention = self._attention(tokens, contexts)  # [m, R]
        experts = self._experts(first, m, slots)  # [m, L, R]
        compute = attention[:, None, :] / L + experts
        slowest = np.argmax(compute, axis=2)  # [m, L]
        pick = lambda a: np.take_along_axis(a, slowest[:, :, None], axis=2)[:, :, 0]  # noqa: E731
        dispatch, combine = (self._exchange(first, m, tier1, tier2, d) for d in ("dispatch", "combine"))  # [m, L]
        link = self.hw.step_link_bytes / self.hw.inter_node.dispatch_bytes_per_s.at(self.R) \
            if self.topology.nodes > 1 else 0.0
        parts = {"attention": pick(np.broadcast_to(attention[:, None, :] / L, compute.shape)).sum(1),
                 "experts": pick(experts).sum(1),
                 "exchange": (dispatch + combine).sum(1) + link,
                 "overhead": np.full(m, self.hw.step_overhead_s), "overlap": np.zeros(m)}
        serial = compute.max(axis=2).sum(1) + parts["exchange"] + parts["overhead"]
        if self.hw.host_overlap == "per_collective":
            # a collective waits for every rank's work before it: the longest rank's attention, then experts
            share = self.hw.step_overhead_s / (1 + 2 * L)  # the host work before each collective of the step
            before_dispatch = attention.max(axis=1)[:, None] / L  # [m, 1]
            before_combine = experts.max(axis=2)  # [m, L]
            composed = np.maximum(share, link) + (np.maximum(share + before_dispatch, dispatch)
                                                  + np.maximum(share + before_combine, combine)).sum(1)
            parts["overlap"] = composed - serial
            return composed, parts
        if not self.overlap:
            return serial, parts
        lanes = []
        for lane in (0, 1):
            half_tokens = (tokens + 1 - lane) // 2  # lane a (0) takes the odd one
            lane_attention = self._attention(half_tokens, contexts * half_tokens / np.maximum(tokens, 1))
            lane_experts = self._experts(first, m, slots, lane)
            lanes.append((lane_attention[:, None, :] / L + lane_experts).max(axis=2))  # [m, L]
        x_lane = sum(self._exchange(first, m, tier1, tier2, d, share=0.5) for d in ("dispatch", "combine"))
        overlapped = (lanes[0] + np.maximum(x_lane, lanes[1]) + x_lane).sum(1) + link + parts["overhead"]
        parts["overlap"] = overlapped - serial
        return overlapped, parts

    def _attention(self, tokens, contexts) -> np.ndarray:
        """[m, R] seconds: KV reads plus the dense roofline (nothing for a rank without rows)."""
        shape, hw = self.shape, self.hw
        kv = contexts * (shape.kv_bytes_per_token / hw.memory_bytes_per_s)
        dense = np.maximum(shape.dense_bytes / hw.memory_bytes_per_s,
                           tokens * (shape.dense_flops_per_token / hw.tensor_flops_per_s))
        return kv + np.where(tokens > 0, dense, 0.0)

    def _experts(self, first: int, m: int, slots, lane: int | None = None) -> np.ndarray:
        """[m, L, R] seconds of routed-expert kernels; `lane` 0/1: that micro-batch's share of each slot."""
        L, R, S = self.L, self.R, self.S
        out = np.zeros((m, L, R))
        if len(slots) == 0:
            return out
        key = ((slots[:, 0] - first) * L + slots[:, 1]) * (R * S) + slots[:, 2]
        key, where = np.unique(key, return_inverse=True)  # a step split over two chunks gives one slot twice
        pairs = np.bincount(where, weights=slots[:, 3]).astype(np.int64)
        if lane is not None:
            pairs = (pairs + 1 - lane) // 2
        shape, hw = self.shape, self.hw
        roof = np.maximum(shape.expert_bytes / hw.memory_bytes_per_s,
                          pairs * (shape.expert_flops_per_token / hw.tensor_flops_per_s))
        seconds = np.where(pairs > 0, roof / hw.efficiency(np.maximum(pairs, 1)), 0.0)
        rank_key = (key // (R * S)) * R + (key % (R * S)) // S  # (step * L + layer) * R + rank
        out += np.bincount(rank_key, weights=seconds, minlength=m * L * R).reshape(m, L, R)
        ran = np.bincount(rank_key, weights=pairs > 0, minlength=m * L * R).reshape(m, L, R) > 0
        return out + np.where(ran, hw.expert_kernel_floor_s, 0.0)

    def _exchange(self, first: int, m: int, tier1, tier2, direction: str, share: float = 1.0) -> np.ndarray:
        """[m, L] seconds of one direction's collective: latency + the busiest unit of either tier."""
        busy = np.zeros((m, self.L))
        for rows, link, cross in ((tier1, self.hw.inter_node, True), (tier2, self.hw.intra_node, False)):
            if (self.topology.nodes if cross else self.G) < 2:
                continue  # the tier does not exist: one node (no tier 1) or one rank a node (no tier 2)
            busy = np.maximum(busy, self._tier_seconds(first, m, rows, link, direction, share))
        return busy + self.latency[direction]

    def _tier_seconds(self, first: int, m: int, rows, link: Link, direction: str, share: float) -> np.ndarray:
        L, R = self.L, self.R
        units = self.topology.nodes if link.shared_by_node else R
        unit = (lambda r: r // self.G) if link.shared_by_node else (lambda r: r)  # noqa: E731
        sender, receiver = (rows[:, 2], rows[:, 3]) if direction == "dispatch" else (rows[:, 3], rows[:, 2])
        wire = rows[:, 4] * (self.row_bytes[direction] * share) + float(link.message_bytes)
        base = ((rows[:, 0] - first) * L + rows[:, 1]) * units
        size = m * L * units
        sent = np.bincount(base + unit(sender), weights=wire, minlength=size)
        received = np.bincount(base + unit(receiver), weights=wire, minlength=size)
        per_unit = np.maximum(sent, received).reshape(m, L, units) + getattr(link, f"{direction}_collective_bytes")
        bandwidth = getattr(link, f"{direction}_bytes_per_s").at(R)
        return per_unit.max(axis=2) / bandwidth


def _merge_rows(rows: np.ndarray, L: int, R: int) -> np.ndarray:
    """[M, 5] (step, layer, sender, receiver, rows) with each key once, its rows summed."""
    if len(rows) == 0:
        return rows
    flat = ((rows[:, 0] * L + rows[:, 1]) * R + rows[:, 2]) * R + rows[:, 3]
    keys, where = np.unique(flat, return_inverse=True)
    summed = np.bincount(where, weights=rows[:, 4], minlength=len(keys)).astype(np.int64)
    return np.stack([keys // (L * R * R), (keys // (R * R)) % L, (keys // R) % R, keys % R, summed], axis=1)
