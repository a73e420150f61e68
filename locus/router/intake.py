"""A client's request, read: what the grouper needs (its id, domain tag, prompt token ids, n and output
bound) and what goes to the backend (the body as that engine wants it, the request id propagated).

The request id is the client's `X-Request-Id`, else its body's `request_id` (vLLM's field), else a new
one. It goes to every backend as `X-Request-Id` (vLLM names its engine request after it), and in the
body as the engine's own field where it has one: `request_id` for Locus (which names its engine request
`cmpl-<id>-<i>`, what its traces record), `rid` for SGLang. The domain tag is Locus's: `"domain"` in the
body or the `X-Locus-Domain` header; it is passed on to Locus backends (their traces record it) and
taken out of the body for the others, which do not know the field.

Everything else is the backend's to check: a request the router can read goes on, and the backend's
400 comes back as it is. The router refuses only what it must read itself (malformed JSON, a prompt it
cannot tokenize, a model nobody behind it serves) with the error Locus's server would give.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from locus.router.admission import RoutedRequest
from locus.router.errors import error_response
from locus.router.prompts import BadPrompt, PromptTokenizer
from locus.router.relay import Outbound

MAX_DOMAIN_CHARS = 64  # as Locus's server (locus/server/protocol.py)
MAX_ID_CHARS = 128
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's, vLLM's and Locus's default for /v1/completions


class Refused(Exception):
    """The request is refused before it reaches a backend: `response` says why."""

    def __init__(self, response):
        super().__init__()
        self.response = response


@dataclass
class Intake:
    tokenizer: PromptTokenizer
    kind: str  # backend kind: locus, vllm, sglang
    models: tuple[str, ...]  # what the backends serve

    def read(self, endpoint: str, raw_body: bytes, headers) -> tuple[RoutedRequest, Outbound]:
        """Raises Refused with the error response."""
        try:
            body = json.loads(raw_body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as exc:
            raise Refused(error_response(400, f"malformed JSON body: {getattr(exc, 'msg', exc)}",
                                         "invalid_request_error")) from None
        if not isinstance(body, dict):
            raise Refused(error_response(400, "the body must be a JSON object", "invalid_request_error"))
        model = body.get("model")
        if model is not None and model not in self.models:
            raise Refused(error_response(404, f"The model `{model}` does not exist (served: {', '.join(self.models)}).",
                                         "NotFoundError", "model"))
        request_id = headers.get("x-request-id") or body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            request_id = secrets.token_hex(12)
        elif len(request_id) > MAX_ID_CHARS or not request_id.isprintable():
            raise Refused(error_response(400, f"the request id may be at most {MAX_ID_CHARS} printable characters",
                                         "invalid_request_error", "request_id"))
        domain = body.get("domain") or headers.get("x-locus-domain")
        if domain is not None and (not isinstance(domain, str) or len(domain) > MAX_DOMAIN_CHARS):
            raise Refused(error_response(400, f"the domain (X-Locus-Domain) must be a string of at most "
                                              f"{MAX_DOMAIN_CHARS} characters", "invalid_request_error", "domain"))
        try:
            if endpoint == "chat":
                prompts = [self.tokenizer.chat_prompt(body.get("messages"), body.get("add_generation_prompt"),
                                                      body.get("add_special_tokens"))]
                max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
            else:
                prompts = self.tokenizer.completion_prompts(body.get("prompt"), body.get("add_special_tokens"))
                max_tokens = body.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
        except BadPrompt as exc:
            raise Refused(error_response(400, str(exc), "invalid_request_error", exc.param)) from None
        n = body.get("n", 1)
        if not _int(n) or n < 1:
            raise Refused(error_response(400, "n must be an integer >= 1", "invalid_request_error", "n"))
        if max_tokens is not None and (not _int(max_tokens) or max_tokens < 0):
            raise Refused(error_response(400, "max_tokens must be an integer >= 0", "invalid_request_error",
                                         "max_tokens"))
        routed = RoutedRequest(request_id, domain or None, prompts, n, max_tokens)
        return routed, Outbound(PATHS[endpoint], self.outbound_body(body, raw_body, request_id),
                                self.outbound_headers(headers, request_id), bool(body.get("stream")))

    def outbound_body(self, body: dict, raw_body: bytes, request_id: str) -> bytes:
        if self.kind == "locus":
            if body.get("request_id") == request_id:
                return raw_body
            if "request_id" not in body:
                added = with_request_id(raw_body, request_id)
                if added is not None:
                    return added
            body["request_id"] = request_id
        else:
            body.pop("domain", None)
            if self.kind == "sglang":
                body["rid"] = request_id
        return json.dumps(body, ensure_ascii=False).encode()

    def outbound_headers(self, headers, request_id: str) -> dict[str, str]:
        out = {"Content-Type": "application/json", "X-Request-Id": request_id}
        for name in ("authorization", "x-locus-domain") if self.kind == "locus" else ("authorization",):
            value = headers.get(name)
            if value is not None:
                out[name] = value
        return out


def with_request_id(raw_body: bytes, request_id: str) -> bytes | None:
    """The body with `"request_id"` written in before its closing brace, the client's bytes otherwise
    as they are: less work on the way out than re-serialising the whole body, for every request that
    names no id. None for a body that is not UTF-8 text of a non-empty object (JSON may come in UTF-16
    or 32): that one is re-serialised."""
    text = raw_body.strip()
    if not text.startswith(b"{") or not text.endswith(b"}") or text[1:-1].strip() == b"":
        return None
    return text[:-1] + b', "request_id": ' + json.dumps(request_id, ensure_ascii=False).encode() + b"}"


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
