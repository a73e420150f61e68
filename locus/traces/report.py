"""Human-readable views of TraceStats: a text summary and optional PNG heatmaps (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from locus.traces.stats import TraceStats


def render_stats(s: TraceStats) -> str:
    """A short text report, one figure per line."""

    def f(x: float | None, digits: int = 3) -> str:
        return "n/a" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{digits}f}"

    lines = [
        f"model {s.model}: {s.num_experts} experts, top-{s.top_k}, {len(s.moe_layers)} MoE layers",
    ]
    if s.num_requests is not None:
        lines.append(
            f"requests {s.num_requests}, tokens {s.num_tokens} (prefill {s.prefill_tokens}, decode {s.decode_tokens})"
        )
        lines.append("domains " + ", ".join(f"{d} {n}" for d, n in s.requests_per_domain.items()))
    elif s.num_tokens is not None:
        lines.append(f"count trace: {s.num_tokens} tokens")
    lines += [
        "load imbalance (max/mean per layer):",
        f"  mean over layers {f(s.max_mean_mean, 2)}, worst {f(s.max_mean_worst, 2)} (layer {s.worst_layer}), "
        f"cv mean {f(s.cv_mean, 2)}",
    ]
    if s.prefill_max_mean is not None or s.decode_max_mean is not None:
        lines.append(f"  prefill rows {f(s.prefill_max_mean, 2)}, decode rows {f(s.decode_max_mean, 2)}")
    if s.domain_js:
        lines.append(
            f"domain specificity (JS divergence, base 2): mean {f(s.js_mean)}, max pair {f(s.js_max)}, "
            f"max single layer {f(s.js_layer_max)}"
        )
        for pair, value in sorted(s.domain_js.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {pair.replace('|', ' vs ')}: {f(value)}")
    if s.pd_requests:
        lines += [
            f"prefill -> decode ({s.pd_requests} requests with both):",
            f"  cosine {f(s.pd_cosine)} (other request's prefill: {f(s.pd_cosine_baseline)})",
            f"  decode share on prefill's top-{s.top_n} experts {f(s.pd_coverage)} "
            f"(other request's prefill: {f(s.pd_coverage_baseline)})",
        ]
    if s.coact_top_lift is not None:
        lines.append(
            f"co-activation: top-pair lift {f(s.coact_top_lift, 2)}, top 1% pairs hold {f(s.coact_top_share)} "
            f"of pairs (independent choices: {f(s.coact_top_share_independent)})"
        )
    if s.inter_layer_mi is not None:
        lines.append(f"inter-layer affinity: MI of first expert at consecutive layers {f(s.inter_layer_mi)} bits")
    return "\n".join(lines)


def write_plots(s: TraceStats, out_dir: str | Path) -> list[Path]:
    """PNG heatmaps: expert load per layer, and domain x expert share at the most domain-specific layer.

    Raises ImportError with an install hint if matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'locus[plots]' (or pip install matplotlib)") from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    load = s.load.astype(np.float64)
    mean = load.mean(axis=1, keepdims=True)
    rel = np.divide(load, mean, out=np.zeros_like(load), where=mean > 0)  # 1.0 = a perfectly balanced expert
    fig, ax = plt.subplots(figsize=(10, 0.12 * len(s.moe_layers) + 2))
    im = ax.imshow(rel, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(0, len(s.moe_layers), max(1, len(s.moe_layers) // 12)))
    ax.set_yticklabels([s.moe_layers[i] for i in range(0, len(s.moe_layers), max(1, len(s.moe_layers) // 12))])
    ax.set_title(f"{s.model}: expert load / layer mean (mean max/mean {s.max_mean_mean or float('nan'):.2f})")
    fig.colorbar(im, ax=ax)
    path = out / "expert_load.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    if len(s.domain_load) >= 2:
        names = sorted(s.domain_load)
        stack = np.stack([s.domain_load[d].astype(np.float64) for d in names])  # [D, L, E]
        share = stack / np.maximum(stack.sum(axis=2, keepdims=True), 1)
        layer = int(np.argmax(share.std(axis=0).sum(axis=1)))  # where domains differ most
        fig, ax = plt.subplots(figsize=(10, 0.4 * len(names) + 2))
        im = ax.imshow(share[:, layer, :] * s.num_experts, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names)
        ax.set_xlabel("expert")
        ax.set_title(f"{s.model}: domain x expert load / uniform, MoE layer {s.moe_layers[layer]}")
        fig.colorbar(im, ax=ax)
        path = out / "domain_expert.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written
