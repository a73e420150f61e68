"""The engines behind the router: which ranks each serves, whether it is up, and how a request is
pinned to one of its ranks.

Two layouts (docs/router.md):
- one endpoint per data-parallel rank (Locus's `locus serve`, vLLM's external load balancing): backend
  b serves rank b, and a request needs no pin;
- one endpoint for several ranks (SGLang's DP attention, vLLM's internal or hybrid load balancing):
  backend b serves ranks b*K .. b*K + K - 1 (K = ranks / backends), and a request carries the
  `X-Data-Parallel-Rank` header with the rank's index among them, the header both engines read to
  pin a request to a data-parallel rank (vLLM: `_get_data_parallel_rank`, SGLang:
  `extract_routed_dp_rank_from_header`).

A backend is up while its `/health` answers 200. The poller asks every `interval` seconds; a request
that cannot reach a backend asks at once. A backend that is down takes no new request; its ranks are
`unavailable` to the grouper until it answers 200 again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from locus.errors import LocusError
from locus.router.upstream import Upstream, UpstreamError

KINDS = ("locus", "vllm", "sglang")
PIN_HEADER = "X-Data-Parallel-Rank"


@dataclass
class Backend:
    index: int
    url: str  # scheme://host:port, no trailing slash
    ranks: tuple[int, ...]
    up: bool = True
    reason: str | None = None  # why it is out, while it is
    since: float = field(default_factory=time.monotonic)  # when `up` last changed

    def pin(self, rank: int) -> str | None:
        """The X-Data-Parallel-Rank value that pins a request to `rank` here (None: one rank, no pin)."""
        if len(self.ranks) == 1:
            return None
        return str(self.ranks.index(rank))


def check_url(url: str) -> str:
    """A backend's base URL, normalised; a bad one is refused by name."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise LocusError(f"--backend {url!r}: expected a base URL such as http://127.0.0.1:8001")
    try:
        parts.port
    except ValueError:
        raise LocusError(f"--backend {url!r}: the port is not a number in 0..65535") from None
    return f"{parts.scheme}://{parts.netloc}"


def lay_out(urls: list[str], ranks: int, kind: str) -> list[Backend]:
    """Each backend's ranks in the plan's topology (module docstring); a count that fits neither layout
    is refused, naming both numbers."""
    if kind not in KINDS:
        raise LocusError(f"--backend-kind {kind!r}: choose one of {', '.join(KINDS)}")
    if not urls:
        raise LocusError("no --backend given: name one endpoint per data-parallel rank of the plan")
    urls = [check_url(u) for u in urls]
    dupes = sorted({u for u in urls if urls.count(u) > 1})
    if dupes:
        raise LocusError(f"--backend {dupes[0]} is given twice: one endpoint serves one rank (or one group of ranks)")
    count = len(urls)
    if count == ranks:
        return [Backend(i, u, (i,)) for i, u in enumerate(urls)]
    if kind == "locus" or ranks % count:
        layouts = "one per rank" if kind == "locus" else f"one per rank, or a divisor of {ranks} with a rank pin"
        raise LocusError(f"the plan's topology has {ranks} data-parallel ranks but {count} backend(s) were given "
                         f"({layouts} for --backend-kind {kind})")
    per = ranks // count
    return [Backend(i, u, tuple(range(i * per, (i + 1) * per))) for i, u in enumerate(urls)]


class BackendPool:
    """The backends, their health, and the poller that keeps it current."""

    def __init__(self, backends: list[Backend], interval: float = 1.0, timeout: float = 2.0):
        self.backends = backends
        self.by_rank = {r: b for b in backends for r in b.ranks}
        self.interval, self.timeout = interval, timeout
        self._probing: dict[int, asyncio.Task] = {}
        self.on_change = None  # called with a backend whose state changed (metrics)

    def unavailable(self) -> tuple[int, ...]:
        """The ranks of the backends that are down."""
        return tuple(r for b in self.backends if not b.up for r in b.ranks)

    def out(self) -> list[Backend]:
        return [b for b in self.backends if not b.up]

    def set_state(self, backend: Backend, up: bool, reason: str | None = None) -> None:
        if backend.up != up:
            backend.up, backend.since = up, time.monotonic()
            if self.on_change is not None:
                self.on_change(backend)
        backend.reason = None if up else reason

    async def probe(self, client: Upstream, backend: Backend) -> bool:
        """Ask the backend's /health now; mark it up or down by the answer."""
        try:
            status, _ = await client.get(backend.url, "/health", self.timeout)
            healthy = status == 200
            reason = None if healthy else f"/health answered {status}"
        except UpstreamError as exc:
            healthy, reason = False, f"/health failed: {describe(exc)}"
        self.set_state(backend, healthy, reason)
        return healthy

    async def probe_soon(self, client: Upstream, backend: Backend) -> bool:
        """One probe at a time per backend: requests failing together share it."""
        task = self._probing.get(backend.index)
        if task is None or task.done():
            task = asyncio.ensure_future(self.probe(client, backend))
            self._probing[backend.index] = task
        return await asyncio.shield(task)

    async def poll(self, client: Upstream) -> None:
        """Probe every backend every `interval` seconds, for ever (cancelled at shutdown)."""
        while True:
            await asyncio.gather(*(self.probe_soon(client, b) for b in self.backends))
            await asyncio.sleep(self.interval)


def describe(exc: BaseException) -> str:
    """An error in a few words: the client's own as it says it, another with its type (some str() are empty)."""
    text = str(exc).strip()
    if isinstance(exc, UpstreamError):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
