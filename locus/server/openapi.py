"""The OpenAPI document (/openapi.json) as the server really behaves.

FastAPI writes the request schemas from the pydantic models; this module adds what it cannot know:
- every operation's responses: the 200 body (the models below: documentation only, the handlers
  build plain dicts), the streamed form as `text/event-stream` whose events (`itemSchema`) are a
  chunk, an error object, or `[DONE]`, and each error status the operation can send, with OpenAI's
  error object (FastAPI's 422 is never sent: validation failures are 400s);
- the limits the server enforces, in the request schemas: the flags' (prompts per request, stop
  text, logit_bias entries) and the model's (vocabulary, context), once it is loaded;
- `/metrics` as Prometheus text.
`tests/server/test_openapi.py` runs schemathesis against a real server with its response checks on.
"""

from __future__ import annotations

import copy
from dataclasses import fields
from typing import Any, Literal, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from locus.engine.ep.counters import ExchangeCounters
from locus.engine.ep.rebalance.replan import ReplanDecision
from locus.engine.observers.trace_recorder import RecordingSummary


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorObject(_Doc):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(_Doc):
    """OpenAI's error shape, for every status the server sends besides 200."""
    error: ErrorObject


class PromptTokensDetails(_Doc):
    cached_tokens: int = Field(description="prompt tokens whose KV the prefix cache served (a multiple of the "
                                           "KV block size)")


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(None, description="only when the prefix cache "
                                                                              "served some of the prompt")


class PromptLogprob(_Doc):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token null (the first) or {token id: its logprob, rank, text}
PromptLogprobs = list[Union[dict[str, PromptLogprob], None]]


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for an echoed prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(description="the token itself and up to `logprobs` "
                                                                    "alternatives; null for an echoed prompt's first token")
    text_offset: list[int]


FinishReason = Literal["stop", "length", "abort", "error"]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTokenLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobEntry(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob]


class ChatLogprobs(_Doc):
    content: list[ChatLogprobEntry]


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None


class ChatCompletionResponse(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Doc):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int | None


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Doc):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(_Doc):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's: the tokenizer's tokenizer_config.json (less file paths), its class and chat template."""
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    model_max_length: int = Field(description="this server's context limit")
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None


class Health(_Doc):
    status: Literal["ok", "degraded"]  # degraded: elastic EP serving on fewer ranks than it started with
    detail: str | None = None


class HealthUnavailable(_Doc):
    status: Literal["loading", "error", "recovering"]  # recovering: EP survivors regrouping (Retry-After)
    detail: str | None


class TraceStatus(_Doc):
    state: Literal["idle", "recording", "stopped", "failed"]
    recording_failures: int
    name: str | None = None
    requests: int | None = None
    tokens: int | None = None
    bytes: int | None = None
    max_bytes: int | None = None
    stop_reason: str | None = None
    reason: str | None = None


class TraceStopped(TraceStatus):
    status: Literal["stopped", "failed"]


class TraceStarted(_Doc):
    status: Literal["recording"]
    path: str


class EPStats(BaseModel):
    """The expert-parallel exchange counters summed over ranks, per rank and per placement epoch."""
    model_config = ConfigDict(extra="allow")
    ranks: int
    assignment: str
    exchange: str
    overlap: bool
    epoch: int
    topology: dict[str, int]
    inter_node_bytes: int
    intra_node_bytes: int
    wire_bytes: int
    tokens: int
    per_rank: list[dict[str, Any]]
    epochs: Any
    replan: dict[str, Any] | None
    recoveries: Any
    retired: dict[str, Any]  # the lost ranks: their summed figures, and "per_rank" (each as it last reported)


class ReplanRequest(_Doc):
    force: bool = False


ERRORS = {
    400: "A parameter, the body or a limit refused (the error's `param` names the field)",
    404: "An unknown model, or an endpoint its flag leaves off",
    409: "A conflict (a trace of that name exists; a re-plan is under way)",
    422: "The re-plan could not be made",
    500: "The engine failed this request alone (the server goes on)",
    503: "Loading, unhealthy, shutting down, or the queue is full (then with Retry-After)",
    507: "The trace directory is full (--trace-max-bytes)",
}

# (path, method) -> (the 200 body's model, or "sse" forms, or "text"; the error statuses it can send)
OPERATIONS: dict[tuple[str, str], tuple[Any, tuple[int, ...]]] = {
    ("/health", "get"): (Health, (503,)),
    ("/metrics", "get"): ("text", ()),
    ("/ep/stats", "get"): (EPStats, (404,)),
    ("/ep/replan", "post"): (ReplanDecision, (400, 404, 409, 422, 503)),
    ("/v1/models", "get"): (ModelList, ()),
    ("/tokenizer_info", "get"): (TokenizerInfo, (503,)),
    ("/tokenize", "post"): (TokenizeResponse, (400, 404, 503)),
    ("/detokenize", "post"): (DetokenizeResponse, (400, 404, 503)),
    ("/traces/start", "post"): (TraceStarted, (400, 404, 409, 503, 507)),
    ("/traces/status", "get"): (TraceStatus, (400, 404, 503)),
    ("/traces/stop", "post"): (TraceStopped, (400, 404, 503)),
    ("/traces/dump", "post"): (RecordingSummary, (400, 404, 503)),
    ("/v1/completions", "post"): (("sse", CompletionResponse, CompletionChunk), (400, 404, 500, 503)),
    ("/v1/chat/completions", "post"): (("sse", ChatCompletionResponse, ChatCompletionChunk), (400, 404, 500, 503)),
}

REF = "#/components/schemas/{model}"

# request bodies worth trying first (schemathesis's examples phase sends them): each form of answer
EXAMPLES = {
    "/v1/completions": {
        "greedy": {"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0},
        "streamed": {"prompt": "Once upon", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
        "scoring": {"prompt": "The cat sat on the mat", "max_tokens": 0, "echo": True, "logprobs": 1},
        "streamed echo": {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "echo": True, "logprobs": 2, "stream": True},
        "biased": {"prompt": "a", "max_tokens": 4, "temperature": 0, "logit_bias": {"65": 100}},
    },
    "/v1/chat/completions": {
        "greedy": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
        "streamed": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                     "logprobs": True, "top_logprobs": 2},
    },
    "/tokenize": {"text": {"prompt": "hello", "return_token_strs": True},
                  "chat": {"messages": [{"role": "user", "content": "hi"}]}},
    "/detokenize": {"ids": {"tokens": [104, 105]}},
}


def install(app: FastAPI, state) -> None:
    """Serve the document below as /openapi.json; it is kept once the model is loaded (its limits
    are known then)."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build(app, state)
        if state.engine is not None:
            app.openapi_schema = document
        return document

    app.openapi = openapi


def build(app: FastAPI, state) -> dict:
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description="Locus: an OpenAI-compatible server for Mixture-of-Experts models. "
                                       "Errors use OpenAI's error object; see docs/serving.md.")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    add_model(schemas, ErrorResponse)
    for (path, method), (ok, errors) in OPERATIONS.items():
        operation = document["paths"].get(path, {}).get(method)
        if operation is None:
            continue
        operation["responses"] = {"200": success(schemas, ok), **{str(s): error(s) for s in errors}}
        if path == "/health":
            operation["responses"]["503"] = json_response("Loading, the engine failed, or EP survivors regrouping",
                                                          add_model(schemas, HealthUnavailable))
        if path in EXAMPLES:
            operation["requestBody"]["content"]["application/json"]["examples"] = {
                name: {"value": value} for name, value in EXAMPLES[path].items()}
        if path == "/ep/replan":  # parsed by hand (an empty body is {}): documented here
            operation["requestBody"] = {"required": False, "content": {
                "application/json": {"schema": add_model(schemas, ReplanRequest)}}}
    apply_limits(schemas, state)
    return document


def add_model(schemas: dict, model) -> dict:
    """Put a pydantic model or dataclass (and the models it refers to) into the components; a $ref to it."""
    adapter = TypeAdapter(model)
    schema = adapter.json_schema(ref_template=REF, mode="serialization")
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    name = model.__name__
    if model in (ReplanDecision, RecordingSummary):  # dataclasses: every field is always there
        schema["required"] = [f.name for f in fields(model)]
    if model is EPStats:
        schema["properties"]["per_rank"]["items"] = {
            "type": "object", "additionalProperties": True,
            "required": ["rank", *[f.name for f in fields(ExchangeCounters)]]}
    schemas[name] = schema
    return {"$ref": REF.format(model=name)}


def json_response(description: str, schema: dict, headers: dict | None = None) -> dict:
    response = {"description": description, "content": {"application/json": {"schema": schema}}}
    if headers:
        response["headers"] = headers
    return response


def success(schemas: dict, ok) -> dict:
    if ok == "text":
        return {"description": "Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}}}
    if isinstance(ok, tuple):  # ("sse", whole response, streamed chunk)
        _, whole, chunk = ok
        response = json_response("The whole response (stream: false)", add_model(schemas, whole))
        data = {"anyOf": [{"const": "[DONE]"},
                          {"type": "string", "contentMediaType": "application/json",
                           "contentSchema": {"anyOf": [add_model(schemas, chunk),
                                                       {"$ref": REF.format(model="ErrorResponse")}]}}]}
        response["description"] = ("The whole response (stream: false), or with stream: true server-sent events: "
                                   "`data: {chunk}` frames, an error object if the request fails mid-stream, "
                                   "then `data: [DONE]`")
        # one event's schema (OpenAPI 3.2's itemSchema, which schemathesis reads in 3.1 documents too)
        response["content"]["text/event-stream"] = {
            "itemSchema": {"type": "object", "required": ["data"], "properties": {"data": data}}}
        return response
    return json_response("OK", add_model(schemas, ok))


def error(status: int) -> dict:
    headers = None
    if status == 503:
        headers = {"Retry-After": {"description": "seconds to wait, when the queue is full or the grammar "
                                                  "compile queue is busy", "schema": {"type": "integer"}}}
    return json_response(ERRORS[status], {"$ref": REF.format(model="ErrorResponse")}, headers)


def apply_limits(schemas: dict, state) -> None:
    """The limits the server enforces, written into the request schemas."""
    limits = state.config.limits
    engine = state.engine
    vocab = max_len = max_chars = None
    if engine is not None:
        vocab = engine.info.vocab_size
        max_len = engine.info.max_model_len
        max_chars = max_len * max(1, engine.info.tokenizer.max_token_chars)
    token = {"type": "integer", "minimum": 0, **({"maximum": vocab - 1} if vocab else {})}
    names = sorted({state.model_name, *([state.config.model] if state.config.model else [])})
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"anyOf": [{"enum": names}, {"type": "null"}], "description": "this server's model (GET /v1/models)"}
        props["stop"] = {"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars},
            {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1, "maxLength": limits.max_stop_chars}},
            {"type": "null"}], "description": "up to 4 stop strings, at most --max-stop-chars characters in all"}
        props["stop_token_ids"] = {"anyOf": [{"type": "array", "items": token}, {"type": "null"}]}
        props["logit_bias"]["anyOf"][0]["maxProperties"] = limits.max_logit_bias
        if vocab:
            _set_number(props, "top_k", maximum=vocab)
        if max_len:
            _set_number(props, "max_tokens", maximum=max_len - 1)
        props["guided_choice"]["anyOf"][0]["maxItems"] = engine.info.grammars.limits.max_choices if engine else 1024
    props = schemas["CompletionRequest"]["properties"]
    text = {"type": "string", **({"maxLength": max_chars} if max_chars else {})}
    ids = {"type": "array", "minItems": 1, "items": token, **({"maxItems": max_len} if max_len else {})}
    props["prompt"] = {"anyOf": [text, {"type": "array", "minItems": 1, "maxItems": limits.max_prompts, "items": text},
                                 ids, {"type": "array", "minItems": 1, "maxItems": limits.max_prompts, "items": ids}],
                       "description": props["prompt"].get("description", "")}
    chat = schemas["ChatCompletionRequest"]["properties"]
    if max_len:
        _set_number(chat, "max_completion_tokens", maximum=max_len - 1)
    detok = schemas["DetokenizeRequest"]["properties"]
    detok["tokens"] = {"type": "array", "items": token, **({"maxItems": max_len} if max_len else {})}
    tok = schemas["TokenizeRequest"]["properties"]
    tok["model"] = copy.deepcopy(schemas["CompletionRequest"]["properties"]["model"])
    detok["model"] = copy.deepcopy(tok["model"])
    if max_chars:
        tok["prompt"] = {"anyOf": [{"type": "string", "maxLength": max_chars}, {"type": "null"}]}


def _set_number(props: dict, name: str, **bounds) -> None:
    """Bounds on a (possibly null) number: numeric keywords apply to numbers only, so they sit beside
    the anyOf, where protocol.bounds puts the others."""
    props[name].update(bounds)
