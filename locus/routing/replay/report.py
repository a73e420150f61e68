"""ReplayReport: the figures `locus replay` prints, built from TrafficTotals (definitions in
replay/metrics.py and docs/design.md, "Metrics")."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from locus.routing.replay.metrics import LinkModel, TrafficTotals
from locus.traces.metrics import max_over_mean


@dataclass
class ReplayReport:
    model: str
    planner: str
    topology: str  # "NxG"
    slots_per_gpu: int
    assignment: str
    requests: tuple[int, int]  # [start, stop) request indices replayed
    tokens: int
    batch_tokens: int
    step_order: str  # "trace" or "ranks" (see replay.py)
    steps: int
    moe_layers: list[int]
    routings: int  # (token, layer, k) pairs with an expert
    inter_node_bytes: int  # node-deduplicated
    inter_node_bytes_nodedup: int
    intra_node_bytes: int  # rank-deduplicated
    intra_node_bytes_nodedup: int
    inter_node_bytes_per_token: float
    intra_node_bytes_per_token: float
    locality: float  # share of pairs served on the token's node
    own_rank_share: float  # share of pairs served on the token's own rank
    expert_imbalance_mean: float  # whole replay: mean over layers of max/mean rank load
    expert_imbalance_worst: float  # whole replay: worst layer
    expert_imbalance_worst_layer: int | None
    step_expert_imbalance_mean: float  # per step: mean over steps of the mean over layers
    step_expert_imbalance_worst: float  # per step: worst (step, layer)
    attention_imbalance: float  # whole replay: max/mean tokens per rank
    step_attention_imbalance_mean: float
    step_attention_imbalance_worst: float
    a2a_seconds: float  # estimated all-to-all time, summed over steps and layers
    a2a_ms_per_step: float
    links: LinkModel = field(default_factory=LinkModel)
    layer_imbalance: list[float] = field(default_factory=list)  # whole replay, per MoE layer
    migrations: int = 0  # requests the grouper moved after prefill (their KV cache moved with them)
    migrated_kv_bytes: int = 0  # inter-node bytes of that KV cache: not in the dispatch figures above
    migrated_kv_bytes_per_token: float = 0.0
    dispatch: str = "position"  # the dispatch rule routed by (dispatch_rule.RULES)
    dispatch_format: str = "model"  # what a dispatched row travels in (formats.PAYLOAD_FORMATS)
    combine_format: str = "model"  # what a combined row travels back in
    # a trace recorded across live re-plans, replayed by its epochs' plans: per epoch, its tokens and bytes
    epochs: list[dict] | None = None
    concurrency: int | None = None  # requests in flight of the `decode` step order (None in the other orders)
    # with a hardware profile: the predicted step time (step_time.StepTimes.summary, plus the profile,
    # model shape and two_batch_overlap); None without one
    step_time: dict | None = None
    # (token, layer) rows by the distinct remote nodes they reach, index = that count: the nodes per token a
    # placement implies (its mean is inter_node_bytes / (2 sends x row bytes x rows))
    remote_nodes: list[int] = field(default_factory=list)
    # with the model's expert groups known (expert_groups.group_figures): the plan's split groups and node bound
    expert_groups: dict | None = None

    @classmethod
    def from_totals(cls, t: TrafficTotals, *, model, planner, topology, assignment, requests, batch_tokens,
                    step_order, moe_layers, links, migrations: int = 0, migrated_kv_bytes: int = 0,
                    dispatch: str = "position", dispatch_format: str = "model",
                    combine_format: str = "model", concurrency: int | None = None,
                    step_time: dict | None = None) -> "ReplayReport":
        layer_imb = max_over_mean(t.layer_loads.astype(np.float64), np.nan)  # [L] over ranks
        known = ~np.isnan(layer_imb)
        u = t.bytes_per_send
        inter_nodedup = t.valid_pairs - t.own_node_pairs
        intra_nodedup = t.intra_node_pairs
        tokens = max(t.tokens, 1)
        return cls(
            model=model,
            dispatch=dispatch,
            dispatch_format=dispatch_format,
            combine_format=combine_format,
            planner=planner,
            topology=f"{topology.nodes}x{topology.gpus_per_node}",
            slots_per_gpu=topology.slots_per_gpu,
            assignment=assignment,
            requests=tuple(requests),
            tokens=t.tokens,
            batch_tokens=batch_tokens,
            step_order=step_order,
            steps=t.steps,
            moe_layers=[int(x) for x in moe_layers],
            routings=t.valid_pairs,
            inter_node_bytes=u * t.inter_node_sends,
            inter_node_bytes_nodedup=u * inter_nodedup,
            intra_node_bytes=u * t.intra_node_sends,
            intra_node_bytes_nodedup=u * intra_nodedup,
            inter_node_bytes_per_token=u * t.inter_node_sends / tokens,
            intra_node_bytes_per_token=u * t.intra_node_sends / tokens,
            locality=_ratio(t.own_node_pairs, t.valid_pairs),
            own_rank_share=_ratio(t.own_rank_pairs, t.valid_pairs),
            expert_imbalance_mean=float(layer_imb[known].mean()) if known.any() else math.nan,
            expert_imbalance_worst=float(layer_imb[known].max()) if known.any() else math.nan,
            expert_imbalance_worst_layer=int(moe_layers[int(np.nanargmax(layer_imb))]) if known.any() else None,
            step_expert_imbalance_mean=_ratio(t.step_expert_imbalance_sum, t.step_expert_imbalance_count),
            step_expert_imbalance_worst=t.step_expert_imbalance_worst,
            attention_imbalance=float(max_over_mean(t.rank_tokens.astype(np.float64), math.nan)),
            step_attention_imbalance_mean=_ratio(t.step_attention_imbalance_sum, t.steps),
            step_attention_imbalance_worst=t.step_attention_imbalance_worst,
            a2a_seconds=t.a2a_seconds,
            a2a_ms_per_step=_ratio(t.a2a_seconds * 1e3, t.steps),
            links=links,
            layer_imbalance=[float(x) for x in layer_imb],
            migrations=int(migrations),
            migrated_kv_bytes=int(migrated_kv_bytes),
            migrated_kv_bytes_per_token=float(migrated_kv_bytes) / tokens,
            epochs=None if t.epochs is None else [
                {"epoch": e, "tokens": n, "inter_node_bytes": u * inter, "intra_node_bytes": u * intra}
                for e, (n, inter, intra) in t.epochs.items()],
            concurrency=concurrency,
            step_time=step_time,
            remote_nodes=[] if t.remote_nodes is None else [int(x) for x in t.remote_nodes],
        )

    def to_dict(self) -> dict:
        """JSON-ready: NaN (a figure with nothing to measure) becomes null; the step-time fields only when set."""
        doc = asdict(self)
        for key in ("concurrency", "step_time", "expert_groups"):
            if doc[key] is None:
                del doc[key]
        return json_safe(doc)

    def format_table(self) -> str:
        gib = 2.0**30
        rows = [
            ("model", self.model),
            ("plan", f"{self.planner} on {self.topology}, {self.slots_per_gpu} slots/GPU"),
            ("assignment", self.assignment),
            ("dispatch rule", self.dispatch),
            *([("payload formats (dispatch / combine)", f"{self.dispatch_format} / {self.combine_format}")]
              if (self.dispatch_format, self.combine_format) != ("model", "model") else []),
            ("requests", f"{self.requests[0]}:{self.requests[1]} ({self.tokens:,} tokens, {self._steps_text()})"),
            ("routings", f"{self.routings:,}"),
            ("inter-node bytes (node-dedup)", f"{self.inter_node_bytes / gib:,.3f} GiB ({self.inter_node_bytes_per_token:,.0f} B/token)"),
            ("inter-node bytes (no dedup)", f"{self.inter_node_bytes_nodedup / gib:,.3f} GiB"),
            ("intra-node bytes (rank-dedup)", f"{self.intra_node_bytes / gib:,.3f} GiB ({self.intra_node_bytes_per_token:,.0f} B/token)"),
            ("intra-node bytes (no dedup)", f"{self.intra_node_bytes_nodedup / gib:,.3f} GiB"),
            ("locality (own node / own rank)", f"{self.locality:.3f} / {self.own_rank_share:.3f}" if self.routings
             else "n/a (no token was routed to an expert)"),
            ("expert imbalance, whole (mean/worst)", f"{self.expert_imbalance_mean:.3f} / {self.expert_imbalance_worst:.3f} (layer {self.expert_imbalance_worst_layer})"),
            ("expert imbalance, per step (mean/worst)", f"{self.step_expert_imbalance_mean:.3f} / {self.step_expert_imbalance_worst:.3f}"),
            ("attention imbalance, whole", f"{self.attention_imbalance:.3f}"),
            ("attention imbalance, per step (mean/worst)", f"{self.step_attention_imbalance_mean:.3f} / {self.step_attention_imbalance_worst:.3f}"),
            *([("KV cache migrated (inter-node)", f"{self.migrated_kv_bytes / gib:,.3f} GiB ({self.migrated_kv_bytes_per_token:,.0f} B/token, {self.migrations:,} moves)")]
              if self.migrations else []),
            *([("placement epochs (tokens, inter / intra B)", "; ".join(
                f"{e['epoch']}: {e['tokens']:,}, {e['inter_node_bytes']:,} / {e['intra_node_bytes']:,}" for e in self.epochs))]
              if self.epochs else []),
            *self._node_rows(),
            ("est. all-to-all time", f"{self.a2a_seconds:.4f} s ({self.a2a_ms_per_step:.3f} ms/step)"),
            ("link model", f"{self.links.inter_gbps:g} GB/s inter, {self.links.intra_gbps:g} GB/s intra, {self.links.latency_us:g} us"),
            *self._step_time_rows(),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


    def remote_nodes_mean_max(self) -> tuple[float, int]:
        """Mean and most remote nodes a (token, layer) row reaches (nan, 0 without rows)."""
        counts = np.asarray(self.remote_nodes, dtype=np.int64)
        if counts.sum() == 0:
            return math.nan, 0
        return float((counts * np.arange(len(counts))).sum() / counts.sum()), int(np.flatnonzero(counts).max())

    def _node_rows(self) -> list[tuple[str, str]]:
        rows = []
        if self.remote_nodes:
            mean, most = self.remote_nodes_mean_max()
            rows.append(("remote nodes per token and layer (mean/max)", f"{mean:.3f} / {most}"))
        if self.expert_groups is not None:
            g = self.expert_groups
            limit = f"top {g['topk_group']}" if g["topk_group"] is not None else "limit unknown"
            rows.append(("expert groups split across nodes", f"{g['split_groups']} of {g['layer_groups']} (layer, group); "
                         f"{g['num_groups']} groups of {g['group_size']}, {limit}"))
            over = g.get("rows_over_limit", 0)
            rows.append(("nodes a token's experts lie on, most (plan / aligned)", f"{g['node_bound']} / {g['aligned_bound']}"
                         + (f"; not a bound here: {over:,} (token, layer) rows route outside {g['topk_group']} groups"
                            if over else "")))
        return rows

    def _steps_text(self) -> str:
        if self.step_order == "decode":
            return f"{self.steps} steps, decode order, {self.concurrency} requests in flight"
        return f"{self.steps} steps of {self.batch_tokens}, {self.step_order} order"

    def _step_time_rows(self) -> list[tuple[str, str]]:
        """The predicted step time's lines (none without a hardware profile)."""
        t = self.step_time
        if t is None:
            return []
        split = t["split_ms"]
        parts = f"attention {split['attention']:.3f}, experts {split['experts']:.3f}, dispatch+combine " \
                f"{split['exchange']:.3f}, overhead {split['overhead']:.3f}"
        host = t.get("host_overlap", "none")  # (a report read back from JSON written before the field)
        if t["two_batch_overlap"]:
            parts += f", two-batch overlap {split['overlap']:+.3f}"
        elif host != "none":  # the serial parts above, and what the profile's composition takes off them
            parts += f", host overlap {split['overlap']:+.3f}"
        name = "predicted TPOT (p50 / p99)" if self.step_order == "decode" else "predicted step time (p50 / p99)"
        return [("step-time model", f"{t['hardware']}, model shape {t['model_shape']}"
                 + (", two-batch overlap" if t["two_batch_overlap"] else "")
                 + (f", host overlap {host}" if host != "none" else "")),
                (name, f"{t['tpot_p50_ms']:.3f} / {t['tpot_p99_ms']:.3f} ms over {t['steps']:,} decoding steps"),
                ("  split (mean ms a step)", parts)]


def _ratio(num, den) -> float:
    return float(num) / float(den) if den else math.nan


def json_safe(value):
    """value with every non-finite float (inf, nan) as None, through dicts and lists: what JSON can hold."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
