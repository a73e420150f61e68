"""One request's trip through the router: admitted to a rank, sent to that rank's backend, the answer
passed back (a stream chunk for chunk), released when it ends.

Faults. A request whose backend fails before the first byte of its answer (no connection, a 5xx, the
connection lost before the first chunk) is released and admitted again, once, with that rank left out:
the next choice. After the first byte the client gets an SSE error frame and the stream ends, never a
silent cut. A backend that could not be reached is probed at once and, if its /health fails, taken out
of the admission until the poller sees it well. A 4xx is the client's answer and passes back as is.

Disconnects. Until the answer ends, the client's connection is watched; when it goes, the backend
request is closed (its engine aborts it, as it does for any client that disconnects) and released.

A stream is passed back at SSE event boundaries: a chunk that ends inside an event waits for the rest
of it, so an error frame never lands inside a half-sent event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

from starlette.responses import Response

from locus.errors import LocusError
from locus.router.admission import Admissions, Placement, RoutedRequest
from locus.router.backends import PIN_HEADER, Backend, BackendPool, describe
from locus.router.errors import error_body, error_frame
from locus.router.metrics import RouterMetrics
from locus.router.upstream import Upstream, UpstreamError, UpstreamResponse

log = logging.getLogger("locus.router")
ATTEMPTS = 2  # the first choice and one retry
# Before a request goes out, the turns of the event loop it yields so that requests sent with it are
# read and admitted too (Relay.after_arrivals): WAVE_TURNS always (a connection opened at the same
# moment takes a turn each to be accepted, read and handed to the app), then while any is still in
# intake, up to WAVE_TURNS_MAX in all.
WAVE_TURNS = 4
WAVE_TURNS_MAX = 12
DONE = b"data: [DONE]\n\n"  # the last event of an OpenAI stream


@dataclass(frozen=True)
class Outbound:
    """What goes to a backend, whichever it is."""

    path: str  # /v1/completions or /v1/chat/completions
    body: bytes
    headers: dict[str, str]
    stream: bool


class Failure(Exception):
    """The backend failed before the answer's first byte: the request may go elsewhere."""

    def __init__(self, stage: str, status: int, message: str):
        super().__init__(message)
        self.stage, self.status, self.message = stage, status, message


class Relay:
    """Shared by every request: the backends, the admission, the metrics and the HTTP client."""

    def __init__(self, pool: BackendPool, admissions: Admissions, metrics: RouterMetrics):
        self.pool, self.admissions, self.metrics = pool, admissions, metrics
        self.upstream: Upstream | None = None  # made on the server's loop (app.py)
        self.arriving = 0  # requests come in whose intake is not done (app.py counts them)

    async def after_arrivals(self) -> None:
        """Let the requests that arrived with this one be read and admitted before it goes out, so
        that a wave reaches its backends as one. Why: a client's requests sent together come out of
        this one event loop a request's work apart (about a millisecond each on a busy machine), and
        an engine that is idle when the first comes waits only briefly for more (Locus's burst wait:
        2 ms of quiet) before prefilling what it has; a wave spread wider than that is prefilled as
        its first request alone and the rest one whole step later. A few turns of the loop cost a
        lone request microseconds."""
        for turn in range(WAVE_TURNS_MAX):
            if turn >= WAVE_TURNS and self.arriving <= 0:
                return
            await asyncio.sleep(0)

    def exchange(self, request: RoutedRequest, outbound: Outbound, arrived: float) -> "Exchange":
        """`arrived`: time.perf_counter() when the request came in (the router's own time is measured)."""
        return Exchange(self, request, outbound, arrived)


class Exchange(Response):
    """The ASGI response of one request (returned by the endpoint, run by Starlette): its status is
    known only once a backend answers, so it sends the start of the response itself."""

    def __init__(self, relay: Relay, request: RoutedRequest, outbound: Outbound, arrived: float):
        self.relay, self.request, self.outbound, self.arrived = relay, request, outbound, arrived
        self.background = None  # Starlette's Response protocol: no background task
        self.placement: Placement | None = None
        self.backend: Backend | None = None
        self.upstream: UpstreamResponse | None = None
        self.streaming = False  # a stream's first event has gone to the client

    async def __call__(self, scope, receive, send) -> None:
        # the exchange runs in Starlette's task; a watcher cancels that task if the client leaves first
        task, state = asyncio.current_task(), {"over": False, "gone": False}

        def client_left(watcher: asyncio.Future) -> None:
            if not watcher.cancelled() and not state["over"]:
                state["gone"] = True
                task.cancel()

        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        watcher.add_done_callback(client_left)
        try:
            await self.run(send)
        except asyncio.CancelledError:
            if not state["gone"]:  # the router is stopping: a stream still open ends with an error frame
                if self.streaming:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(send({"type": "http.response.body", "more_body": False, "body": error_frame(
                            503, "the router is shutting down", "service_unavailable")}))
                raise
            task.uncancel()  # our own cancel, handled: the task goes on (Starlette's end of the request)
        finally:
            state["over"] = True
            watcher.cancel()
            self.close_upstream()  # the client left: closing the backend request aborts it there
            self.end()

    # --- the attempts -------------------------------------------------------------------------------
    async def run(self, send) -> None:
        relay, request = self.relay, self.request
        tried: list[int] = []
        failure: Failure | None = None
        for _ in range(ATTEMPTS):
            unavailable = set(relay.pool.unavailable()) | set(tried)
            try:
                self.placement = relay.admissions.admit(request, sorted(unavailable))
            except LocusError:
                break  # no rank left to try
            if tried:
                relay.metrics.rank[tried[-1]].retries.inc()
            self.count_admission()
            try:
                await self.attempt(send)
                return
            except Failure as exc:
                failure = exc
                rank = self.placement.rank
                relay.metrics.failures.labels(*relay.metrics.labels(rank), exc.stage).inc()
                log.warning("request %s failed on rank %d (%s) before its first byte: %s", request.request_id, rank,
                            self.backend.url, exc.message)
                self.end()
                tried.append(rank)
        if failure is None:
            down = ", ".join(f"{b.url} ({b.reason})" for b in relay.pool.out()) or "none"
            await send_json(send, 503, error_body(503, f"no backend can take the request; out: {down}",
                                                  "service_unavailable"), {"Retry-After": "1"})
            return
        await send_json(send, failure.status, error_body(failure.status, failure.message, "server_error"))

    def count_admission(self) -> None:
        m, p = self.relay.metrics, self.placement
        m.admissions.labels(p.how, p.domain or "").inc()
        if p.overflowed:
            m.overflowed.inc()

    async def attempt(self, send) -> None:
        """Send to the placement's backend; pass the answer back. Failure: nothing reached the client."""
        relay, out, rank = self.relay, self.outbound, self.placement.rank
        backend = self.backend = relay.pool.by_rank[rank]
        series = relay.metrics.rank[rank]
        series.requests.inc()
        series.in_flight.inc()
        headers = out.headers
        pin = backend.pin(rank)
        if pin is not None:
            headers = {**headers, PIN_HEADER: pin}
        await relay.after_arrivals()
        try:
            self.upstream = response = await relay.upstream.request(backend.url, "POST", out.path, out.body, headers)
        except UpstreamError as exc:
            await self.suspect(backend)
            raise Failure("connect", 502, f"the backend of rank {rank} ({backend.url}) could not be reached: "
                                          f"{describe(exc)}") from None
        if response.status >= 500:
            text = await self.read_quietly(response)
            raise Failure("status", response.status, f"the backend of rank {rank} ({backend.url}) answered "
                                                     f"{response.status}: {error_message(text)}")
        if response.status != 200 or not out.stream:  # a whole answer (or a client error): read, then pass on
            try:
                data = await response.read()
            except UpstreamError as exc:
                await self.suspect(backend)
                raise Failure("connect", 502, f"the backend of rank {rank} ({backend.url}) failed before its "
                                              f"answer ended: {describe(exc)}") from None
            await send({"type": "http.response.start", "status": response.status,
                        "headers": answer_headers(response, self.request.request_id)})
            await send({"type": "http.response.body", "body": data})
            return
        try:
            first = await response.readany()
        except UpstreamError as exc:
            first, error = b"", exc
        else:
            error = None
        if not first:
            await self.suspect(backend)
            why = describe(error) if error is not None else "the stream ended empty"
            raise Failure("connect", 502, f"the backend of rank {rank} ({backend.url}) failed before its first "
                                          f"byte: {why}")
        await send({"type": "http.response.start", "status": 200,
                    "headers": answer_headers(response, self.request.request_id)})
        # the router's own time: arrival to the request's last byte on the socket, and the first
        # chunk's read to its hand-over to the server
        before, got = response.sent - self.arrived, response.first_body
        await self.pump(send, first, lambda: relay.metrics.overhead.observe(before + time.perf_counter() - got))

    async def pump(self, send, first: bytes, first_sent) -> None:
        """Pass the stream on at event boundaries; a failure after the first byte is an error frame.
        `first_sent` is called once the first event is on its way to the client."""
        pending = first
        content = self.upstream
        while True:
            cut = pending.rfind(b"\n\n")
            if cut >= 0:
                piece, pending = pending[: cut + 2], pending[cut + 2:]
                done = piece.endswith(DONE)
                # the last event ends the answer in the same write (the client may send its next
                # request before the backend closes the stream)
                await send({"type": "http.response.body", "body": piece, "more_body": not done})
                if first_sent is not None:
                    self.streaming = True
                    first_sent()
                    first_sent = None
                if done:
                    # release now, or the client's next request would find this one still charged;
                    # then read the backend's end, so its connection can be reused
                    self.end()
                    await self.drain(content)
                    return
            try:
                chunk = await content.readany()
            except UpstreamError as exc:
                await self.fail_stream(send, describe(exc))
                return
            if not chunk:
                break
            pending = pending + chunk if pending else chunk
        if pending.strip():  # the stream ended inside an event: the backend was cut off
            await self.fail_stream(send, "the stream ended inside an event")
            return
        await send({"type": "http.response.body", "body": b""})

    async def drain(self, content: UpstreamResponse) -> None:
        """Read what is left of an answer the client already has (nothing, normally), ignoring faults."""
        with contextlib.suppress(UpstreamError):
            while await content.readany():
                pass

    async def fail_stream(self, send, why: str) -> None:
        rank, backend = self.placement.rank, self.backend
        self.relay.metrics.failures.labels(*self.relay.metrics.labels(rank), "stream").inc()
        log.warning("request %s lost its backend mid-stream (rank %d, %s): %s", self.request.request_id, rank,
                    backend.url, why)
        self.close_upstream()
        await send({"type": "http.response.body", "more_body": False, "body": error_frame(
            502, f"the backend of rank {rank} ({backend.url}) failed mid-stream: {why}")})
        await self.suspect(backend)

    # --- bookkeeping --------------------------------------------------------------------------------
    async def suspect(self, backend: Backend) -> None:
        """A transport error: ask the backend's /health now (it is taken out if that fails too)."""
        self.close_upstream()
        await self.relay.pool.probe_soon(self.relay.upstream, backend)

    async def read_quietly(self, response: UpstreamResponse) -> bytes:
        try:
            return await response.read()
        except UpstreamError:
            return b""

    def close_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()  # an unfinished body closes the connection: the backend sees the client go
            self.upstream = None

    def end(self) -> None:
        """The request's attempt is over: release its admission and in-flight count (once)."""
        if self.placement is None:
            return
        self.relay.admissions.release(self.request.request_id)
        self.relay.metrics.rank[self.placement.rank].in_flight.dec()
        self.placement = None


def answer_headers(response: UpstreamResponse, request_id: str) -> list[tuple[bytes, bytes]]:
    kept = [(b"content-type", response.headers.get("content-type", "application/json").encode("latin-1"))]
    for name in ("cache-control", "x-accel-buffering"):
        if name in response.headers:
            kept.append((name.encode(), response.headers[name].encode("latin-1")))
    kept.append((b"x-request-id", request_id.encode("latin-1", "replace")))
    return kept


async def send_json(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *extra]})
    await send({"type": "http.response.body", "body": raw})


async def wait_for_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def error_message(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return text[:200] or "(no body)"
