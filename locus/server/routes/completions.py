"""Generation: POST /v1/completions and POST /v1/chat/completions, whole or streamed (SSE).

Every request is validated and admitted completely (schema, text, sampling ranges, context limit,
queue room) before anything streams, so a bad or refused request gets a proper status code; errors
that happen mid-stream are sent as one SSE error frame.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from locus.engine.frontend.async_engine import AsyncEngine
from locus.engine.core.outputs import RequestOutput
from locus.engine.sampling.sampler import InvalidParameter
from locus.server import responses
from locus.server.errors import sse_error
from locus.server.event_stream import Block, EventStreamResponse, ListenedEventStream, wait_for_disconnect
from locus.server.prompts import check_text_size, off_loop_if_large, text_chars
from locus.server.protocol import MAX_DOMAIN_CHARS, ChatCompletionRequest, CompletionRequest
from locus.server.state import ServerState


T = TypeVar("T")

# The one thread that builds scoring responses (prompts x n x tokens x logprob entries, up to
# --max-logprob-entries): off the event loop, which would answer nothing else for the seconds a large
# one takes. One thread and not a pool: the memory a build frees is reused by the next build, where a
# pool's threads each keep what they freed in their own malloc arena (docs/serving.md, "Request limits").
_BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="locus-build")


async def built_off_loop(items: Iterator[T]) -> AsyncIterator[T]:
    """`items`, each built on the builder thread while the event loop serves the others."""
    loop = asyncio.get_running_loop()
    while (item := await loop.run_in_executor(_BUILDER, next, items, None)) is not None:
        yield item


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        engine = state.accept(body)
        params = body.sampling_params(body.max_tokens, body.logprobs, body.engine_prompt_logprobs())
        info, chars = engine.info, text_chars(body.prompt)
        tok = info.tokenizer
        if isinstance(body.prompt, str):
            check_text_size(chars, tok, info.max_model_len, "prompt")
        elif body.prompt and isinstance(body.prompt[0], str):
            for text in body.prompt:
                check_text_size(len(text), tok, info.max_model_len, "prompt")
        prompts = await off_loop_if_large(chars, lambda: responses.completion_prompts(body.prompt, tok,
                                                                                      body.add_special_tokens))
        state.config.limits.check_logprob_entries(body, [len(p) for p in prompts], info.max_model_len)
        fmt = responses.CompletionFormat.for_request(state.model_name, tok, body)
        return await serve(raw, engine, prompts, params, body, "cmpl", fmt)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        engine = state.accept(body)
        params = body.sampling_params(body.effective_max_tokens, body.logprobs_count)
        tok = engine.info.tokenizer
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        chars = text_chars(messages)
        check_text_size(chars, tok, engine.info.max_model_len, "messages")
        prompt = await off_loop_if_large(chars, lambda: tok.encode(
            tok.apply_chat_template(messages, body.add_generation_prompt), add_special_tokens=body.add_special_tokens))
        return await serve(raw, engine, [prompt], params, body, "chatcmpl", responses.ChatFormat(state.model_name, tok))

    async def compile_constraint(engine: AsyncEngine, so) -> None:
        """Compile (and check) an output constraint in the compile pools; past its time budget the
        request is refused and the compile's result only goes to the cache (sampling/grammar_limits.py)."""
        grammars = engine.info.grammars
        if grammars.is_compiled(so):
            return
        if not grammars.prepared:  # the server's one-time cost (xgrammar's import, the vocabulary): not timed
            await asyncio.get_running_loop().run_in_executor(None, grammars.prepare)
        future = state.compile_pools.submit(so, grammars.check_satisfiable)
        seconds = grammars.limits.compile_seconds
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=seconds)
        except asyncio.TimeoutError:
            raise InvalidParameter(so.param, f"the {so.kind} constraint did not compile within {seconds:g} s "
                                             "(--max-grammar-compile-seconds)") from None

    async def serve(raw: Request, engine: AsyncEngine, prompts, params, body, prefix: str, fmt):
        if params.structured is not None:  # compiling can take a while: in its pool, within its budget
            await compile_constraint(engine, params.structured)
        # Everything that can refuse the request does so here, before a byte is sent: the engine's one
        # check of each prompt (nothing checks it again), then admission, synchronously (no await in
        # between), so the queue limit is exact.
        requests = [engine.validate(p, params) for p in prompts]
        engine.check_admission(len(prompts))
        request_id = f"{prefix}-{body.request_id or uuid.uuid4().hex[:24]}"
        domain = body.domain or raw.headers.get("x-locus-domain")
        if domain is not None and len(domain) > MAX_DOMAIN_CHARS:
            raise InvalidParameter("domain", f"the domain (X-Locus-Domain) may be at most {MAX_DOMAIN_CHARS} characters")
        final_only = not body.stream  # a whole response needs only each request's finished output
        streams = []
        try:
            for i, request in enumerate(requests):
                streams.append(engine.admit(request, f"{request_id}-{i}", domain, final_only))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            # the usual case: written from the engine's per-step delivery
            if len(streams) == 1 and not fmt.streamed_off_loop:
                return ListenedEventStream(streams[0], frame_renderer(fmt, request_id, params.n, include_usage), sse_error,
                                           "".join(fmt.stream_start(request_id, 1, params.n)), headers)
            return EventStreamResponse(stream_events(streams, params.n, request_id, fmt, include_usage,
                                                     fmt.streamed_off_loop), headers)
        finals = await until_disconnected(raw, collect_all(streams))
        if finals is None:
            return Response(status_code=499)  # client gone; nobody reads this
        if fmt.built_off_loop:
            return StreamingResponse(built_off_loop(fmt.json_chunks(request_id, finals, params.n)),
                                     media_type="application/json")
        return JSONResponse(fmt.full_response(request_id, finals, params.n))

    return router


async def collect_all(streams):
    async def last(stream):
        final = None
        async for out in stream:
            final = out
        return final

    try:
        return await asyncio.gather(*(last(s) for s in streams))
    finally:  # one prompt's error (or the caller's cancellation) ends the others too
        for stream in streams:
            await stream.aclose()


async def until_disconnected(raw: Request, coro):
    """Run coro; if the client disconnects first, cancel it (which aborts the engine requests).

    A watcher waits for the server's disconnect message instead of polling: a poll every 0.25 s
    per request ran an anyio cancel scope on the event loop, which shares the cores (and the GIL)
    with the forward pass."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


def frame_renderer(fmt, request_id: str, n: int, include_usage: bool) -> Callable[[RequestOutput], Block]:
    """One prompt's outputs -> SSE text: every frame of an output in one block; the finished output's
    block also carries the usage chunk (if asked) and `[DONE]`, and ends the body."""
    usage = responses.Usage()

    def render(out: RequestOutput) -> Block:
        text = "".join(fmt.stream_chunk(request_id, 0, n, out, usage))
        if not out.finished:
            return text, False
        return text + stream_end(fmt, request_id, usage, include_usage), True

    return render


def stream_end(fmt, request_id: str, usage: "responses.Usage", include_usage: bool) -> str:
    """What closes every stream: the usage chunk (when asked for), then `[DONE]`."""
    return (fmt.usage_chunk(request_id, usage) if include_usage else "") + "data: [DONE]\n\n"


async def stream_events(streams, n: int, request_id: str, fmt, include_usage: bool,
                        off_loop: bool = False) -> AsyncIterator[Block]:
    """The SSE text of several prompts' output streams, one block per engine output (one write
    each); the block that ends the body carries the usage chunk and `[DONE]`. An error inside a
    stream becomes one error frame, which ends the body. Closing this generator (client gone)
    closes the streams, which aborts their requests. `off_loop`: each frame is built in a worker
    thread and written alone (an echoed prompt's logprobs: n large frames at once)."""
    usage = responses.Usage()
    start = "".join(fmt.stream_start(request_id, len(streams), n))
    if start:
        yield start, False
    merged = merge_streams(streams)
    try:
        async for i, item in merged:
            if isinstance(item, BaseException):
                yield sse_error(item), True
                return
            try:
                if off_loop:
                    async for frame in built_off_loop(fmt.stream_frames(request_id, i, n, item, usage)):
                        yield frame, False
                    continue
                text = "".join(fmt.stream_chunk(request_id, i, n, item, usage))
            except Exception as exc:  # noqa: BLE001 - sent to the client as an SSE error frame
                yield sse_error(exc), True
                return
            if text:
                yield text, False
    finally:
        await merged.aclose()
    yield stream_end(fmt, request_id, usage, include_usage), True


async def merge_streams(streams):
    """(prompt index, output or error) from every stream, in arrival order; an error ends the merge."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - forwarded to the client as an SSE error frame
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(tasks)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            yield i, item
            if isinstance(item, BaseException):
                return
    finally:
        for t in tasks:
            t.cancel()
