"""OpenAI request schemas (pydantic) and their translation into engine sampling parameters.

Field names, defaults and ranges follow OpenAI's API; vLLM's extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) are accepted too. Range checks live
in one place, SamplingParams.validate, so the engine and the server can never disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from locus.engine.sampling import InvalidParameter, SamplingParams
from locus.engine.structured_output import StructuredOutput

MAX_DOMAIN_CHARS = 64  # a request's task family is stored in traces: bounded, like every client string there


@dataclass(frozen=True)
class RequestLimits:
    """What one request may cost, each a `locus serve` flag; a request past one is a 400 naming it."""

    max_body_bytes: int = 32 << 20  # --max-request-body-bytes (docs/serving.md says why these defaults)
    max_prompts: int = 1024  # --max-prompts-per-request: prompts of one /v1/completions request
    max_stop_chars: int = 4096  # --max-stop-chars: the characters of all of a request's stop strings

    def check(self, body: BaseModel) -> None:
        """The checks that cost nothing: before the body is walked, tokenized or queued."""
        prompt = getattr(body, "prompt", None)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > self.max_prompts:
            raise InvalidParameter("prompt", f"{len(prompt)} prompts in one request; this server takes at most "
                                             f"{self.max_prompts} (--max-prompts-per-request)")
        stop = getattr(body, "stop", None)
        chars = len(stop) if isinstance(stop, str) else sum(len(s) for s in stop or () if isinstance(s, str))
        if chars > self.max_stop_chars:
            raise InvalidParameter("stop", f"the stop strings hold {chars} characters; this server takes at most "
                                           f"{self.max_stop_chars} in all (--max-stop-chars)")


def check_messages(messages: list["ChatMessage"]) -> None:
    """A content part must be {"type": "text", "text": <a string>}: this model serves text only, and
    anything else in `text` (a nested part, a number) would reach the chat template's join."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise InvalidParameter(f"messages[{i}].content", f"this model serves text only: content part "
                                       f"type {kind!r} is not supported")
            if not isinstance(part.get("text"), str):
                got = "missing" if "text" not in part else f"a JSON {_json_type(part['text'])}"
                raise InvalidParameter(f"messages[{i}].content[{j}].text",
                                       f"a text content part's text must be a string; it is {got}")


def _json_type(value: object) -> str:
    return {dict: "object", list: "array", bool: "boolean", type(None): "null", int: "number",
            float: "number"}.get(type(value), type(value).__name__)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as OpenAI does

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # vLLM: the logprob of every prompt token given its prefix, and top-k
    # Locus: the task family (code, math, chat, ...) for traces and the grouper; header X-Locus-Domain works too
    domain: str | None = Field(None, max_length=MAX_DOMAIN_CHARS)
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and structured_outputs object
    response_format: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one output constraint the request asks for (a 400 if it asks for several)."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text") if isinstance(rf, dict) else None
            if kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise InvalidParameter("response_format", "response_format json_schema needs json_schema.schema, a JSON object")
                found.append(StructuredOutput("json", json.dumps(schema), "response_format"))
            elif kind == "json_object":
                found.append(StructuredOutput("json_object", "", "response_format"))
            elif kind != "text":
                raise InvalidParameter("response_format", f"response_format type must be text, json_object or json_schema, got {kind!r}")
        if self.guided_json is not None:
            schema = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            found.append(StructuredOutput("json", schema, "guided_json"))
        if self.guided_regex is not None:
            found.append(StructuredOutput("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(StructuredOutput("choice", json.dumps(self.guided_choice), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(StructuredOutput("grammar", self.guided_grammar, "guided_grammar"))
        for key, value in (self.structured_outputs or {}).items():
            if value is None or value is False:
                continue
            if key == "json":
                found.append(StructuredOutput("json", value if isinstance(value, str) else json.dumps(value), "structured_outputs"))
            elif key == "json_object":
                found.append(StructuredOutput("json_object", "", "structured_outputs"))
            elif key == "choice":
                found.append(StructuredOutput("choice", json.dumps(value), "structured_outputs"))
            elif key in ("regex", "grammar"):
                found.append(StructuredOutput(key, str(value), "structured_outputs"))
            else:
                raise InvalidParameter("structured_outputs", f"unknown structured_outputs key {key!r} "
                                       "(json, json_object, regex, choice, grammar)")
        if len(found) > 1:
            raise InvalidParameter(found[1].param, "give one output constraint: " + ", ".join(sorted({f.param for f in found})) + " were given together")
        return found[0] if found else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options", "stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidParameter("prompt_logprobs", "prompt_logprobs is returned with whole responses only (stream: false)")
        params = SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=SamplingParams.normalize_stop(self.stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs,
            structured=self.structured_output(),
        )
        params.validate()
        return params


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        if self.suffix:
            raise InvalidParameter("suffix", "suffix (insertion) is not supported")
        if self.echo:
            raise InvalidParameter("echo", "echo is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of", "best_of other than n is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise InvalidParameter("logprobs", f"logprobs must be in [0, 5] for completions, got {self.logprobs}")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None

    def check_unsupported(self) -> None:
        if not self.messages:
            raise InvalidParameter("messages", "messages must contain at least one message")
        if self.tools:
            raise InvalidParameter("tools", "tool calling is not supported")
        if self.tool_choice not in (None, "none"):
            raise InvalidParameter("tool_choice", "tool calling is not supported (tool_choice may only be \"none\")")
        check_messages(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidParameter("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}")

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check_unsupported(self) -> None:
        if self.messages is not None:
            check_messages(self.messages)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class TraceStartRequest(BaseModel):
    """POST /traces/start: `path` names a trace inside the server's --trace-dir (letters, digits, '.', '_',
    '-'; no path separators), default <model>-<time>."""

    path: str | None = Field(None, max_length=128)
