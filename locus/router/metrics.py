"""The router's Prometheus metrics (GET /metrics): per backend, what it holds and what happened to the
requests sent to it; per admission reason, where the grouper's choices came from.

    locus_route_backend_up{backend,ranks}            1 while /health answers 200
    locus_route_in_flight{backend,rank}              requests sent and not finished
    locus_route_requests_total{backend,rank}         requests sent (a retried one counts on both)
    locus_route_retries_total{backend,rank}          requests that failed there before their first byte
                                                     and went to another rank
    locus_route_failures_total{backend,rank,stage}   failures there: stage "connect" (no answer), "status"
                                                     (a 5xx), "stream" (after the first byte: an error frame)
    locus_route_admissions_total{how,domain}         admissions by reason (tagged, predicted, least-loaded)
                                                     and the domain that placed them ("" for none): the
                                                     predicted-domain counts are how="predicted"
    locus_route_overflowed_total                     admissions whose preferred ranks were all full
    locus_route_overhead_seconds                     the router's own time on a stream's first token: from
                                                     the request's arrival to its last byte written to the
                                                     backend's socket, plus from the read that brought the
                                                     first chunk to its hand-over to the server (what it
                                                     adds to TTFT, less the sockets' and the wake-ups' time)
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from locus.router.backends import Backend

OVERHEAD_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)


@dataclass(frozen=True)
class RankSeries:
    """One rank's per-request series."""

    in_flight: Gauge
    requests: Counter
    retries: Counter


class RouterMetrics:
    def __init__(self, backends: list[Backend]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.up = Gauge("locus_route_backend_up", "1 while the backend's /health answers 200.", ["backend", "ranks"],
                        registry=r)
        self.in_flight = Gauge("locus_route_in_flight", "Requests sent to the backend and not finished.",
                               ["backend", "rank"], registry=r)
        self.requests = Counter("locus_route_requests", "Requests sent to the backend.", ["backend", "rank"], registry=r)
        self.retries = Counter("locus_route_retries", "Requests that failed on the backend before their first byte "
                               "and were sent to another rank.", ["backend", "rank"], registry=r)
        self.failures = Counter("locus_route_failures", "Requests that failed on the backend, by stage: connect, "
                                "status (5xx) or stream (after the first byte).", ["backend", "rank", "stage"],
                                registry=r)
        self.admissions = Counter("locus_route_admissions", "The grouper's admissions by reason and by the domain "
                                  "that placed them.", ["how", "domain"], registry=r)
        self.overflowed = Counter("locus_route_overflowed", "Admissions whose preferred ranks were all full.", registry=r)
        self.overhead = Histogram("locus_route_overhead_seconds", "The router's own time on a stream's first token "
                                  "(reading, tokenizing, admitting, sending; reading and relaying the first chunk).", registry=r,
                                  buckets=OVERHEAD_BUCKETS)
        self._labels = {}
        self.rank: dict[int, RankSeries] = {}  # bound once: labels() takes a lock and a lookup per call
        for b in backends:
            self.backend_changed(b)
            for rank in b.ranks:
                labels = self._labels[rank] = (b.url, str(rank))
                self.rank[rank] = RankSeries(self.in_flight.labels(*labels), self.requests.labels(*labels),
                                             self.retries.labels(*labels))

    def labels(self, rank: int) -> tuple[str, str]:
        return self._labels[rank]

    def backend_changed(self, backend: Backend) -> None:
        self.up.labels(backend.url, ",".join(map(str, backend.ranks))).set(1 if backend.up else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
