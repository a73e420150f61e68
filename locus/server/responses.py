"""OpenAI response bodies and SSE chunks for completions and chat completions.

Choice indices: prompt i, choice j -> index i * n + j (as OpenAI numbers choices of a list prompt).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.engine.sampling.sampler import InvalidParameter, TokenLogprob
from locus.engine.checkpoint.tokenizer import Tokenizer
from locus.server import scoring


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seen_prompts: frozenset = frozenset()
    # per prompt: its tokens the prefix cache served, counted once however many choices (n) share it
    cached_tokens: dict[int, int] = field(default_factory=dict)

    def note_cached(self, prompt_index: int, out: RequestOutput) -> None:
        """Keep a prompt's first known count (a request counts its first admission, as vLLM's)."""
        if out.num_cached_tokens is not None:
            self.cached_tokens.setdefault(prompt_index, out.num_cached_tokens)

    def as_dict(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}
        cached = sum(self.cached_tokens.values())
        if cached:  # OpenAI's field; vLLM sends it only with --enable-prompt-tokens-details, Locus when > 0
            body["prompt_tokens_details"] = {"cached_tokens": cached}
        return body


def completion_prompts(prompt, tokenizer: Tokenizer, add_special_tokens: bool = True) -> list[list[int]]:
    """OpenAI's four prompt forms -> token-id lists (texts get the tokenizer's BOS unless
    add_special_tokens is false; token ids are taken as they are)."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=add_special_tokens)]
    if not prompt:
        raise InvalidParameter("prompt", "the prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompt]
    return [list(p) for p in prompt]


# One encoder for every frame: json.dumps(..., ensure_ascii=False) builds a new one per call.
_JSON = json.JSONEncoder(ensure_ascii=False)
# ensure_ascii=False's string encoder (C), for the text spliced into a frame template.
_encode_text = json.encoder.encode_basestring
# Stands for the text while a template is rendered; no model text contains a NUL-framed name.
_TEXT_MARK = "\x00locus-delta-text\x00"
# A whole response written in parts: the bytes Starlette's JSONResponse writes (compact, no NaN).
_BODY_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
# Where a body's choices go; a JSON string escapes its quotes, so only the key itself reads like this.
_CHOICES_MARK = '"choices":[]'


def sse(obj: dict) -> str:
    return f"data: {_line_safe(_JSON.encode(obj))}\n\n"


def _line_safe(encoded: str) -> str:
    """Escape the characters that JSON allows raw but line-splitting SSE clients (Python's
    str.splitlines, as in httpx's aiter_lines) take for line breaks. They can only occur inside
    JSON strings, where \\uXXXX is the same character."""
    if encoded.isascii():
        return encoded
    return encoded.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").replace("\x85", "\\u0085")


class _Format:
    object_name = ""
    chunk_object = ""
    report_prompt_logprobs = True  # False when the engine scored the prompt for echo, not for the client
    built_off_loop = False  # whether a whole response is built in a worker thread, written choice by choice
    streamed_off_loop = False  # whether a stream's frames are built in a worker thread, written one by one

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        self.model_name, self.tokenizer = model_name, tokenizer
        self.created = int(time.time())
        # A format serves one HTTP request (one request id), so its per-choice state is keyed by choice.
        self._templates: dict[int, tuple[str, str]] = {}  # choice -> the frame around its text
        self._token_texts: dict[int, str] = {}  # token id -> token_text: a scoring response names each one often
        self._vllm_prompt: tuple[int, list[dict | None]] | None = None  # the last prompt's prompt_logprobs

    def token_text(self, token_id: int) -> str:
        """A token's own text; a piece of a multi-byte character (not text on its own) is named
        `token_id:N` so that logprob alternatives never collide on U+FFFD."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            text = self._token_texts[token_id] = f"token_id:{token_id}" if "\ufffd" in text else text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        raw = getattr(self.tokenizer, "token_bytes", None)
        if raw is not None:
            return list(raw(token_id))
        return list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))

    def full_response(self, request_id: str, finals: list[RequestOutput], n: int) -> dict:
        body, choices = self.response_parts(request_id, finals, n)
        body["choices"] = list(choices)
        return body

    def json_chunks(self, request_id: str, finals: list[RequestOutput], n: int) -> Iterator[bytes]:
        """The whole response's JSON (the bytes of JSONResponse(full_response(...))), one choice per
        chunk, each built when it is asked for: n choices of a scored prompt can add up to tens of MB,
        which built at once would hold the event loop for seconds and hundreds of MB at a time."""
        body, choices = self.response_parts(request_id, finals, n)
        body["choices"] = []
        head, tail = _BODY_JSON.encode(body).split(_CHOICES_MARK, 1)
        yield (head + '"choices":[').encode()
        separator = ""
        for choice in choices:
            yield (separator + _BODY_JSON.encode(choice)).encode()
            separator = ","
        yield ("]" + tail).encode()

    def response_parts(self, request_id: str, finals: list[RequestOutput], n: int) -> tuple[dict, Iterator[dict]]:
        """The whole response's body with its "choices" to come, and those choices in index order,
        each built as the iterator reaches it."""
        usage = Usage()
        for i, out in enumerate(finals):
            usage.prompt_tokens += len(out.prompt_token_ids)
            usage.note_cached(i, out)
            usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        body = {"id": request_id, "object": self.object_name, "created": self.created, "model": self.model_name,
                "choices": None, "usage": usage.as_dict()}
        if self.report_prompt_logprobs and finals and finals[0].prompt_logprobs is not None:
            self.attach_prompt_logprobs(body, finals)
        return body, self._full_choices(finals, n)

    def _full_choices(self, finals: list[RequestOutput], n: int) -> Iterator[dict]:
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                yield self.full_choice(i * n + c.index, c, i, out)

    def vllm_prompt_logprobs(self, prompt_index: int, out: RequestOutput) -> list[dict | None]:
        """A prompt's prompt_logprobs, built once for all its choices (they hold the same lists)."""
        if self._vllm_prompt is None or self._vllm_prompt[0] != prompt_index:
            self._vllm_prompt = (prompt_index, self.prompt_logprobs(out.prompt_logprobs))
        return self._vllm_prompt[1]

    def prompt_logprobs(self, entries: list[TokenLogprob | None]) -> list[dict | None]:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
        holding the prompt token itself and the position's top alternatives."""
        out: list[dict | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ranked = {entry.token_id: (entry.logprob, entry.rank)}
            for rank, (token_id, logprob) in enumerate(entry.top, start=1):
                ranked.setdefault(token_id, (logprob, rank))
            out.append({str(t): {"logprob": lp, "rank": r, "decoded_token": self.token_text(t)} for t, (lp, r) in ranked.items()})
        return out

    def attach_prompt_logprobs(self, body: dict, finals: list[RequestOutput]) -> None:
        """Where the body's prompt_logprobs go besides the choices' (chat's, at the top level)."""

    def stream_start(self, request_id: str, num_prompts: int, n: int) -> list[str]:
        return []

    def stream_chunk(self, request_id: str, prompt_index: int, n: int, out: RequestOutput, usage: Usage) -> list[str]:
        return list(self.stream_frames(request_id, prompt_index, n, out, usage))

    def stream_frames(self, request_id: str, prompt_index: int, n: int, out: RequestOutput, usage: Usage) -> Iterator[str]:
        """One output's SSE frames, each built when the iterator reaches it (an echoed prompt's frames
        are large: routes/completions.py builds them one at a time off the event loop)."""
        if prompt_index not in usage.seen_prompts:
            usage.seen_prompts = usage.seen_prompts | {prompt_index}
            usage.prompt_tokens += len(out.prompt_token_ids)
        usage.note_cached(prompt_index, out)
        for c in out.outputs:
            usage.completion_tokens += len(c.delta_token_ids)
            index = prompt_index * n + c.index
            if c.finish_reason is None and c.logprobs is None and self.plain(index):
                if c.delta_text or c.delta_token_ids:
                    yield self._text_frame(request_id, index, c.delta_text)
            elif c.delta_text or c.delta_token_ids or c.finish_reason or not self.plain(index):
                yield sse(self._chunk(request_id, [self.delta_choice(index, c, prompt_index, out)]))

    def plain(self, index: int) -> bool:
        """Whether choice `index`'s next chunk is its text delta alone (its frame can come from a template)."""
        return True

    def _text_frame(self, request_id: str, index: int, text: str) -> str:
        """The frame of a plain text delta (no logprobs, not the last): the same bytes as
        sse(_chunk(...delta_choice...)), from a template rendered once per choice, so a token costs
        one string escape instead of building and encoding the chunk (the event loop shares the
        cores with the model)."""
        template = self._templates.get(index)
        if template is None:
            probe = CompletionOutput(index=0, text="", token_ids=[], delta_text=_TEXT_MARK, delta_token_ids=[0])
            rendered = sse(self._chunk(request_id, [self.delta_choice(index, probe, 0, None)]))
            head, tail = rendered.split(_encode_text(_TEXT_MARK))
            template = self._templates[index] = (head, tail)
        return template[0] + _line_safe(_encode_text(text)) + template[1]

    def usage_chunk(self, request_id: str, usage: Usage) -> str:
        body = self._chunk(request_id, [])
        body["usage"] = usage.as_dict()
        return sse(body)

    def _chunk(self, request_id: str, choices: list[dict]) -> dict:
        return {"id": request_id, "object": self.chunk_object, "created": self.created, "model": self.model_name,
                "choices": choices}

    def full_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        raise NotImplementedError

    def delta_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        raise NotImplementedError


@dataclass
class _Echo:
    """A prompt's echo, shared by its n choices: its text, and its part of `logprobs` (when asked for)."""

    text: str
    logprobs: dict | None


class CompletionFormat(_Format):
    object_name = chunk_object = "text_completion"

    def __init__(self, model_name: str, tokenizer: Tokenizer, echo: "scoring.PromptEcho | None" = None,
                 top_n: int | None = None, skip_special_tokens: bool = True):
        super().__init__(model_name, tokenizer)
        self.echo = echo  # echo: each choice's text (and logprobs) start with its prompt's
        self.top_n = top_n  # the request's logprobs: alternatives per token (the prompt's may have been scored wider)
        self.skip_special_tokens = skip_special_tokens  # how the output text was decoded (text_offset follows it)
        self._echoed: set[int] = set()  # streamed choices whose prompt went out already
        self._last_echo: tuple[int, _Echo] | None = None  # (prompt index, its echo): a prompt's n choices come together
        self._offsets: dict[int, scoring.OutputOffsets] = {}  # streamed choice -> text_offset of its next tokens

    @classmethod
    def for_request(cls, model_name: str, tokenizer: Tokenizer, body) -> "CompletionFormat":
        fmt = cls(model_name, tokenizer, scoring.PromptEcho.of(body, tokenizer), body.logprobs, body.skip_special_tokens)
        fmt.report_prompt_logprobs = body.prompt_logprobs is not None  # (echo scores the prompt for itself)
        return fmt

    @property
    def built_off_loop(self) -> bool:
        """Whether a whole response carries logprob entries: prompts x n x tokens x (logprobs + 1) of
        them, up to --max-logprob-entries, too many to build on the event loop."""
        return self.top_n is not None or self.report_prompt_logprobs

    @property
    def streamed_off_loop(self) -> bool:
        """Whether a stream's frames carry an echoed prompt's logprobs: its first frame per choice is
        as large as a whole scoring response."""
        return self.echo is not None and self.top_n is not None

    def logprobs(self, entries: list[scoring.Entry], offsets: list[int]) -> dict:
        """OpenAI's completion logprobs: per token its text, logprob, the alternatives with the token
        itself (so up to top_n + 1 of them, as OpenAI and vLLM give) and where its piece of the text
        starts; a prompt's first token has a null logprob and null alternatives."""
        tokens, token_logprobs, top = [], [], []
        for token_id, logprob, alternatives in entries:
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            if alternatives is None:
                top.append(None)
                continue
            chosen = {text: logprob}
            chosen.update((self.token_text(t), v) for t, v in alternatives[:self.top_n])
            top.append(chosen)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _echo_of(self, prompt_index: int, out: RequestOutput) -> _Echo:
        """A prompt's echo, built once for all its choices."""
        if self._last_echo is not None and self._last_echo[0] == prompt_index:
            return self._last_echo[1]
        text = self.echo.text(prompt_index, out.prompt_token_ids)
        lp = None
        if self.top_n is not None:
            entries = scoring.prompt_entries(out.prompt_token_ids, out.prompt_logprobs)
            lp = self.logprobs(entries, self.echo.offsets(text, out.prompt_token_ids))
        echo = _Echo(text, lp)
        self._last_echo = (prompt_index, echo)
        return echo

    def _output_logprobs(self, echo: _Echo | None, items: list[TokenLogprob], offsets: "scoring.OutputOffsets") -> dict:
        """A choice's logprobs for `items` (its generated tokens, or those of one chunk), after its
        prompt's when `echo` is given."""
        own = self.logprobs(scoring.output_entries(items), offsets.take([lp.token_id for lp in items]))
        if echo is None:
            return own
        return {key: echo.logprobs[key] + own[key] for key in own}

    def full_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        echo = self._echo_of(prompt_index, out) if self.echo is not None else None
        text = echo.text + c.text if echo is not None else c.text
        lp = None
        if c.logprobs is not None:
            offsets = scoring.OutputOffsets(self.tokenizer, out.prompt_token_ids, self.skip_special_tokens,
                                            len(echo.text) if echo is not None else 0)
            lp = self._output_logprobs(echo, c.logprobs, offsets)
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if self.report_prompt_logprobs and out.prompt_logprobs is not None:  # as vLLM: on every choice, its own prompt's
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(prompt_index, out)
        return choice

    def plain(self, index: int) -> bool:
        return self.echo is None or index in self._echoed

    def delta_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        text, echo = c.delta_text, None
        if not self.plain(index):  # this choice's first chunk: its prompt, then what it generated so far
            self._echoed.add(index)
            echo = self._echo_of(prompt_index, out)
            text = echo.text + text
        lp = None
        if c.logprobs is not None:
            offsets = self._offsets.get(index)
            if offsets is None:  # text_offset continues across chunks, as in the whole response
                start = len(echo.text) if echo is not None else 0
                offsets = self._offsets[index] = scoring.OutputOffsets(self.tokenizer, out.prompt_token_ids,
                                                                       self.skip_special_tokens, start)
            lp = self._output_logprobs(echo, c.delta_logprobs or [], offsets)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


class ChatFormat(_Format):
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token_text(token_id), "logprob": logprob, "bytes": self.token_bytes(token_id)}

    def logprobs(self, items: list[TokenLogprob] | None) -> dict | None:
        if items is None:
            return None
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in items]}

    def full_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def attach_prompt_logprobs(self, body: dict, finals: list[RequestOutput]) -> None:
        body["prompt_logprobs"] = self.vllm_prompt_logprobs(0, finals[0])  # as vLLM: one prompt, at the top level

    def stream_start(self, request_id: str, num_prompts: int, n: int) -> list[str]:
        # the first chunk of each choice carries the role, as OpenAI's do
        return [sse(self._chunk(request_id, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}])) for i in range(num_prompts * n)]

    def delta_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        delta = {"content": c.delta_text} if (c.delta_text or not c.finish_reason) else {}
        lp = self.logprobs(c.delta_logprobs) if c.logprobs is not None else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
