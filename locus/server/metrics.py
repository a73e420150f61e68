"""Prometheus metrics: engine gauges and counters read at scrape time, latency histograms observed
as requests finish, and per-layer expert load counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from locus.engine.ep.ranks.health import RankSnapshot
from locus.engine.frontend.async_engine import AsyncEngine
from locus.engine.frontend.health import RecordingState
from locus.engine.core.outputs import RequestOutput
from locus.engine.requests.sequence import RequestMetrics

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class EngineCollector:
    """Reads the engine's snapshot on every scrape, so gauges are never stale."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        s = self.engine.stats()
        labels = ["model_name"]
        v = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(v, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(v, value)
            return c

        yield gauge("locus_num_requests_running", "Requests whose sequences hold KV blocks.", s.num_running)
        yield gauge("locus_num_requests_waiting", "Requests waiting for KV blocks.", s.num_waiting)
        yield gauge("locus_kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1).", s.kv_usage)
        yield gauge("locus_kv_cache_free_blocks", "Free KV-cache blocks.", s.num_free_blocks)
        yield gauge("locus_kv_cache_total_blocks", "KV-cache blocks in the pool.", s.num_blocks)
        yield counter("locus_num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions)
        yield counter("locus_prompt_tokens", "Prompt tokens of admitted requests.", s.prompt_tokens)
        yield counter("locus_generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter("locus_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("locus_prefix_cache_hits", "Prompt blocks reused from the prefix cache.", s.prefix_cache_hits)
        # under expert parallelism, every rank's load (each rank counts the tokens it routes)
        load = self.engine.expert_load()
        if load is not None:
            c = CounterMetricFamily("locus_expert_tokens", "(token, slot) pairs routed to each expert, per MoE layer.",
                                    labels=["model_name", "layer", "expert"])
            for layer, counts in load.items():
                for expert, n in enumerate(counts):
                    c.add_metric([self.model_name, str(layer), str(expert)], n)
            yield c
        yield from recording_metrics(self.engine.recording(), self.model_name)
        ranks = self.engine.ep_ranks()  # under expert parallelism: its exchange counters too
        if ranks:
            yield from ep_metrics(ranks, self.model_name)


RECORDING_STATES = ("idle", "recording", "stopped", "failed")


def recording_metrics(recording: RecordingState, model_name: str):
    """The trace recording (--record-trace or /traces/start): its state (1 = current), why it stopped or
    failed (a short code: requested, budget, or the error's, e.g. ENOSPC), its bytes, and how many
    recordings an error stopped."""
    current = recording.state
    g = GaugeMetricFamily("locus_trace_recording_state", "The trace recording's state: 1 for the current one.",
                          labels=["model_name", "state"])
    for name in RECORDING_STATES:
        g.add_metric([model_name, name], 1.0 if name == current else 0.0)
    yield g
    if recording.stop_reason is not None:
        r = GaugeMetricFamily("locus_trace_recording_stop_reason", "Why the recording takes no more requests "
                              "(requested, budget, or the error that failed it, e.g. ENOSPC).",
                              labels=["model_name", "reason"])
        r.add_metric([model_name, recording.stop_reason], 1.0)
        yield r
    b = GaugeMetricFamily("locus_trace_recording_bytes", "Bytes the current recording's trace holds.",
                          labels=["model_name"])
    b.add_metric([model_name], recording.written_bytes)
    yield b
    c = CounterMetricFamily("locus_trace_recording_failures", "Recordings stopped by an error (a full disk, say); "
                            "requests are never failed by one.", labels=["model_name"])
    c.add_metric([model_name], recording.failures)
    yield c


def ep_metrics(ranks: list[RankSnapshot], model_name: str):
    """Expert parallelism: exchange bytes summed over ranks by tier and direction (docs/design.md's
    definitions, as GET /ep/stats and `locus replay`), and per rank its tokens, expert load and step
    time split, as of the last iteration every rank reported. Every rank that served counts, the ones
    a regroup lost included (frozen at their last report), and a rank's series is labelled with the
    rank it was started as, which a regroup never renumbers: no counter runs backwards."""
    counters, times = [r.counters for r in ranks], [r.times for r in ranks]
    labels = [str(r.identity) for r in ranks]
    b = CounterMetricFamily("locus_ep_bytes", "Expert-parallel payload bytes sent, summed over ranks.",
                            labels=["model_name", "tier", "direction"])
    for tier in ("inter_node", "intra_node"):
        for direction in ("dispatch", "combine"):
            b.add_metric([model_name, tier, direction], sum(getattr(c, f"{tier}_{direction}") for c in counters))
    for tier in ("inter_node", "intra_node"):  # KV cache of requests moved after their prefill (--ep-moves)
        b.add_metric([model_name, f"migration_{tier}", "kv"], sum(getattr(c, f"migration_{tier}") for c in counters))
    yield b
    meta = CounterMetricFamily("locus_ep_metadata_bytes", "Routing metadata bytes sent (slot ids, weights, counts), summed over ranks.",
                               labels=["model_name"])
    meta.add_metric([model_name], sum(c.metadata for c in counters))
    yield meta
    wire = CounterMetricFamily("locus_ep_wire_bytes", "Bytes the expert-parallel exchanges really sent (padding, packed "
                               "metadata and counts included; never payload), summed over ranks.",
                               labels=["model_name", "tier", "direction"])
    for tier in ("inter_node", "intra_node"):
        for direction in ("dispatch", "combine"):
            wire.add_metric([model_name, tier, direction], sum(getattr(c, f"wire_{tier}_{direction}") for c in counters))
    yield wire
    rank_families = [
        ("locus_ep_rank_tokens", "Tokens this rank ran through the MoE layers (its requests' tokens).",
         lambda i: ranks[i].tokens),
        ("locus_ep_rank_expert_pairs", "(token, slot) pairs this rank's experts computed, summed over MoE layers: its expert load.",
         lambda i: counters[i].expert_pairs),
        ("locus_ep_rank_steps", "Iterations in which this rank ran a step.", lambda i: times[i].steps),
    ]
    for name, doc, value in rank_families:
        c = CounterMetricFamily(name, doc + " rank: the rank it was started as.", labels=["model_name", "rank"])
        for i, label in enumerate(labels):
            c.add_metric([model_name, label], value(i))
        yield c
    seconds = CounterMetricFamily("locus_ep_rank_step_seconds", "Wall time of this rank's steps, by part: compute, "
                                  "exchange (MoE all-to-all, less expert compute), control (gloo control collectives). "
                                  "rank: the rank it was started as.",
                                  labels=["model_name", "rank", "part"])
    for label, tm in zip(labels, times):
        for part, value in (("compute", tm.compute_s), ("exchange", tm.exchange_s), ("control", tm.control_s)):
            seconds.add_metric([model_name, label, part], value)
    yield seconds


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        h = dict(labelnames=["model_name"], registry=self.registry, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("locus_time_to_first_token_seconds", "Time to first token.", **h)
        self.itl = Histogram("locus_inter_token_latency_seconds", "Time between consecutive output tokens.", **h)
        self.e2e = Histogram("locus_e2e_request_latency_seconds", "Arrival to finish.", **h)
        self.queue = Histogram("locus_request_queue_time_seconds", "Arrival to first scheduled.", **h)
        self.finished = Counter("locus_request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        # the one label set, bound once: labels() takes a lock and a dict lookup, and the ITL
        # histogram is observed once per generated token
        self._ttft, self._itl = self.ttft.labels(model_name), self.itl.labels(model_name)
        self._e2e, self._queue = self.e2e.labels(model_name), self.queue.labels(model_name)

    def observe_output(self, out: RequestOutput) -> None:
        """AsyncEngine's on_finished hook: every request's last output, aborted and failed ones too."""
        self.observe_finished(out.metrics, [c.finish_reason for c in out.outputs])

    def observe_finished(self, metrics: RequestMetrics, finish_reasons: list[str | None]) -> None:
        if metrics.ttft is not None:
            self._ttft.observe(metrics.ttft)
        observe_gap = self._itl.observe
        for gap in metrics.inter_token_latencies:
            observe_gap(gap)
        if metrics.e2e_latency is not None:
            self._e2e.observe(metrics.e2e_latency)
        if metrics.queue_time is not None:
            self._queue.observe(metrics.queue_time)
        for reason in finish_reasons:
            self.finished.labels(self.model_name, reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
