"""bench/serve_lib/raw_http.py, the load client of bench/serve.py: against a loopback server that
writes scripted responses (split at every byte, in one piece, or paced), what it reports for a
stream, an error status, a connection cut mid-stream and bytes that are not HTTP, and that the
times it reports are those the bytes arrived at, though it parses them after the run."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from tests.bench.bench_scripts import BENCH

sys.path.insert(0, str(BENCH))
from serve_lib.load import settle  # noqa: E402
from serve_lib.raw_http import HttpTarget, send_request_raw  # noqa: E402


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def sse(*chunks: dict | str) -> list[bytes]:
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n".encode() for c in chunks]


TOKEN = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def serve_once(response: bytes | list[bytes], split: bool, pause: float = 0.0):
    """A server that reads one request, answers `response` (one byte a write when split; a list:
    one write a piece, `pause` seconds apart) and closes."""
    requests: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")][0].split(b":")[1])
        requests.append(head + await reader.readexactly(length))
        pieces = response if isinstance(response, list) else [response]
        if split:
            pieces = [response[i:i + 1] for i in range(len(response))]
        for n, piece in enumerate(pieces):
            if n and pause:
                await asyncio.sleep(pause)
            writer.write(piece)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions", requests


def fetch(response: bytes | list[bytes], split: bool = False, pause: float = 0.0):
    async def main():
        server, url, requests = await serve_once(response, split, pause)
        async with server:
            recorded = await asyncio.wait_for(send_request_raw(HttpTarget.of(url), {"prompt": [1, 2], "stream": True}, False, 2), 10)
        time.sleep(10 * pause)  # parsed well after the bytes came: the times must still be the arrivals'
        return settle(recorded), requests

    return asyncio.run(main())


@pytest.mark.parametrize("split", [False, True])
def test_a_chunked_event_stream_is_counted_and_timed_however_it_is_split(split):
    body = sse(TOKEN, TOKEN, dict(TOKEN, choices=[{"index": 0, "text": "y", "finish_reason": "length"}]), USAGE, "[DONE]")
    result, requests = fetch(HEAD + chunked(body[0], body[1] + body[2], *body[3:]), split)
    assert result.ok, result.error
    assert (result.output_tokens, result.prompt_tokens, len(result.itl)) == (3, 5, 2)
    assert 0 < result.ttft <= result.e2e
    head, _, payload = requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Connection: close" in head
    assert json.loads(payload) == {"prompt": [1, 2], "stream": True}


def test_token_times_are_the_arrival_times_of_their_reads():
    body = sse(TOKEN, TOKEN, TOKEN, USAGE, "[DONE]")
    pieces = [HEAD + chunked(body[0])[:-5], b"%x\r\n%s\r\n" % (len(body[1]), body[1]),
              b"%x\r\n%s\r\n" % (len(body[2]), body[2]), chunked(*body[3:])]
    result, _ = fetch(pieces, pause=0.1)
    assert result.ok, result.error
    assert result.output_tokens == 3 and len(result.itl) == 2
    assert all(0.08 < gap < 0.5 for gap in result.itl), result.itl
    assert 0.25 < result.e2e < 0.9 and result.ttft < 0.25  # the last read came ~0.3 s in; parsed 1 s later


def test_an_error_status_reports_the_servers_message():
    error = json.dumps({"error": {"message": "max_tokens is too large", "type": "invalid_request_error"}}).encode()
    for framing in (b"content-length: %d\r\n" % len(error), b"transfer-encoding: chunked\r\n"):
        body = error if b"length" in framing else chunked(error[:10], error[10:])
        result, _ = fetch(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n" + framing + b"\r\n" + body, split=True)
        assert not result.ok and result.error == "HTTP 400: max_tokens is too large"


def test_a_stream_error_chunk_fails_the_request():
    body = sse(TOKEN, {"error": {"message": "engine step failed", "type": "server_error"}}, "[DONE]")
    result, _ = fetch(HEAD + chunked(*body))
    assert not result.ok and result.error == "stream error: engine step failed"


def test_a_connection_cut_mid_stream_and_bytes_that_are_not_http_are_errors():
    result, _ = fetch(HEAD + chunked(*sse(TOKEN))[:-5])  # no last chunk: cut
    assert not result.ok and "closed the connection before the response ended" in result.error
    result, _ = fetch(b"SSH-2.0-OpenSSH\r\n\r\n")
    assert not result.ok and "not an HTTP/1.x status line" in result.error
    result, _ = fetch(HEAD + b"zz\r\n")
    assert not result.ok and result.error.startswith("ValueError")
    result, _ = fetch(HEAD + chunked(b"data: {not json}\n\n"))
    assert not result.ok and "JSONDecodeError" in result.error


def test_a_refused_connection_and_an_https_url_are_errors_not_exceptions():
    async def refused():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        return await send_request_raw(HttpTarget.of(f"http://127.0.0.1:{port}/v1/completions"), {}, False, None)

    result = settle(asyncio.run(refused()))
    assert not result.ok and "ConnectionRefusedError" in result.error
    with pytest.raises(ValueError, match="plain http"):
        HttpTarget.of("https://example.com/v1/completions")
