"""OpenAI response bodies and SSE chunks for completions and chat completions.

Choice indices: prompt i, choice j -> index i * n + j (as OpenAI numbers choices of a list prompt).
"""

from __future__ import annotations

import json
import time
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

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        self.model_name, self.tokenizer = model_name, tokenizer
        self.created = int(time.time())
        # A format serves one HTTP request (one request id), so its per-choice state is keyed by choice.
        self._templates: dict[int, tuple[str, str]] = {}  # choice -> the frame around its text
        self._text_offsets: dict[int, int] = {}  # choice -> text_offset of its next streamed token

    def token_text(self, token_id: int) -> str:
        """A token's own text; a piece of a multi-byte character (not text on its own) is named
        `token_id:N` so that logprob alternatives never collide on U+FFFD."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return f"token_id:{token_id}" if "\ufffd" in text else text

    def token_bytes(self, token_id: int) -> list[int]:
        raw = getattr(self.tokenizer, "token_bytes", None)
        if raw is not None:
            return list(raw(token_id))
        return list(self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8"))

    def full_response(self, request_id: str, finals: list[RequestOutput], n: int) -> dict:
        usage = Usage()
        choices = []
        for i, out in enumerate(finals):
            usage.prompt_tokens += len(out.prompt_token_ids)
            usage.note_cached(i, out)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(self.full_choice(i * n + c.index, c, i, out))
        choices.sort(key=lambda ch: ch["index"])
        body = {"id": request_id, "object": self.object_name, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage.as_dict()}
        if self.report_prompt_logprobs and finals and finals[0].prompt_logprobs is not None:
            self.attach_prompt_logprobs(body, [self.prompt_logprobs(out.prompt_logprobs) for out in finals], n)
        return body

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

    def attach_prompt_logprobs(self, body: dict, per_prompt: list[list[dict | None]], n: int) -> None:
        raise NotImplementedError

    def stream_start(self, request_id: str, num_prompts: int, n: int) -> list[str]:
        return []

    def stream_chunk(self, request_id: str, prompt_index: int, n: int, out: RequestOutput, usage: Usage) -> list[str]:
        if prompt_index not in usage.seen_prompts:
            usage.seen_prompts = usage.seen_prompts | {prompt_index}
            usage.prompt_tokens += len(out.prompt_token_ids)
        usage.note_cached(prompt_index, out)
        frames = []
        for c in out.outputs:
            usage.completion_tokens += len(c.delta_token_ids)
            index = prompt_index * n + c.index
            if c.finish_reason is None and c.logprobs is None and self.plain(index):
                if c.delta_text or c.delta_token_ids:
                    frames.append(self._text_frame(request_id, index, c.delta_text))
            elif c.delta_text or c.delta_token_ids or c.finish_reason or not self.plain(index):
                frames.append(sse(self._chunk(request_id, [self.delta_choice(index, c, prompt_index, out)])))
        return frames

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


class CompletionFormat(_Format):
    object_name = chunk_object = "text_completion"

    def __init__(self, model_name: str, tokenizer: Tokenizer, echo: "scoring.PromptEcho | None" = None,
                 top_n: int | None = None):
        super().__init__(model_name, tokenizer)
        self.echo = echo  # echo: each choice's text (and logprobs) start with its prompt's
        self.top_n = top_n  # the request's logprobs: alternatives per token (the prompt's may have been scored wider)
        self._echoed: set[int] = set()  # streamed choices whose prompt went out already

    @classmethod
    def for_request(cls, model_name: str, tokenizer: Tokenizer, body) -> "CompletionFormat":
        fmt = cls(model_name, tokenizer, scoring.PromptEcho.of(body, tokenizer), body.logprobs)
        fmt.report_prompt_logprobs = body.prompt_logprobs is not None  # (echo scores the prompt for itself)
        return fmt

    def logprobs(self, entries: list[scoring.Entry] | None, offset: int = 0) -> dict | None:
        """OpenAI's completion logprobs: per token its text, logprob, the alternatives with the token
        itself (so up to top_n + 1 of them, as OpenAI and vLLM give) and its text offset; a prompt's
        first token has a null logprob and null alternatives."""
        if entries is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, logprob, alternatives in entries:
            text = self.token_text(token_id)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            token_logprobs.append(logprob)
            if alternatives is None:
                top.append(None)
                continue
            chosen = {text: logprob}
            chosen.update((self.token_text(t), v) for t, v in alternatives[:self.top_n])
            top.append(chosen)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _entries(self, c: CompletionOutput, items: list[TokenLogprob] | None, echo: bool,
                 out: RequestOutput | None) -> list[scoring.Entry] | None:
        """A choice's logprob entries: the prompt's first when it is echoed, then its own `items`."""
        if c.logprobs is None:
            return None
        entries = scoring.output_entries(items or [])
        if echo:
            return scoring.prompt_entries(out.prompt_token_ids, out.prompt_logprobs) + entries
        return entries

    def full_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        echo = self.echo is not None
        text = (self.echo.text(prompt_index, out.prompt_token_ids) + c.text) if echo else c.text
        return {"index": index, "text": text, "logprobs": self.logprobs(self._entries(c, c.logprobs, echo, out)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def attach_prompt_logprobs(self, body: dict, per_prompt: list[list[dict | None]], n: int) -> None:
        for choice in body["choices"]:  # as vLLM: on every choice, its own prompt's
            choice["prompt_logprobs"] = per_prompt[choice["index"] // n]

    def plain(self, index: int) -> bool:
        return self.echo is None or index in self._echoed

    def delta_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        text, echo = c.delta_text, not self.plain(index)
        if echo:  # this choice's first chunk: its prompt, then what it generated so far
            self._echoed.add(index)
            text = self.echo.text(prompt_index, out.prompt_token_ids) + text
        lp = None
        if c.logprobs is not None:
            # text_offset continues across chunks, as in the whole response
            start = self._text_offsets.get(index, 0)
            lp = self.logprobs(self._entries(c, c.delta_logprobs, echo, out), start)
            if lp["tokens"]:
                self._text_offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
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

    def attach_prompt_logprobs(self, body: dict, per_prompt: list[list[dict | None]], n: int) -> None:
        body["prompt_logprobs"] = per_prompt[0]  # as vLLM: one prompt, at the top level

    def stream_start(self, request_id: str, num_prompts: int, n: int) -> list[str]:
        # the first chunk of each choice carries the role, as OpenAI's do
        return [sse(self._chunk(request_id, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None}])) for i in range(num_prompts * n)]

    def delta_choice(self, index: int, c: CompletionOutput, prompt_index: int = 0, out: RequestOutput | None = None) -> dict:
        delta = {"content": c.delta_text} if (c.delta_text or not c.finish_reason) else {}
        lp = self.logprobs(c.delta_logprobs) if c.logprobs is not None else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}
