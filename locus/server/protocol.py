"""OpenAI request schemas (pydantic) and their translation into engine sampling parameters.

Field names, defaults and ranges follow OpenAI's API; vLLM's extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) are accepted too. Range checks live
in one place, SamplingParams.check_ranges, so the engine and the server can never disagree; the ranges
the schemas show (`bounds`) are the same constants, for the OpenAPI document.

Types are strict (as OpenAI's are): a boolean or a float is not a token id nor a count, a string is
not a number, a number is not a boolean. Every field is honoured or refused (unsupported.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from locus.engine.sampling.sampler import InvalidParameter, SamplingParams
from locus.engine.sampling.params import LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SEED_RANGE
from locus.engine.sampling.grammar import StructuredOutput
from locus.server.unsupported import EMPTY, FALSE, check_refused, check_unknown, refused

MAX_DOMAIN_CHARS = 64  # a request's task family is stored in traces: bounded, like every client string there


@dataclass(frozen=True)
class RequestLimits:
    """What one request may cost, each a `locus serve` flag; a request past one is a 400 naming it."""

    max_body_bytes: int = 32 << 20  # --max-request-body-bytes (docs/serving.md says why these defaults)
    max_prompts: int = 1024  # --max-prompts-per-request: prompts of one /v1/completions request
    max_stop_chars: int = 4096  # --max-stop-chars: the characters of all of a request's stop strings
    max_logit_bias: int = 1024  # --max-logit-bias: entries of one request's logit_bias
    # --max-logprob-entries: the logprob entries one /v1/completions response may hold (about 32 MB of JSON)
    max_logprob_entries: int = 1 << 20

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
        bias = getattr(body, "logit_bias", None)
        if bias is not None and len(bias) > self.max_logit_bias:
            raise InvalidParameter("logit_bias", f"logit_bias has {len(bias)} entries; this server takes at most "
                                                 f"{self.max_logit_bias} (--max-logit-bias)")


    def check_logprob_entries(self, body: "CompletionRequest", prompt_lengths: list[int], max_model_len: int) -> None:
        """What the response will hold, known once the prompts are tokenized, checked before they are
        queued: echo and n multiply a prompt's entries with no work from the engine (one ~40 KB body
        asked for ~100 MB of JSON)."""
        entries = body.logprob_entries(prompt_lengths, max_model_len)
        if entries > self.max_logprob_entries:
            param = "logprobs" if body.logprobs is not None else "prompt_logprobs"
            raise InvalidParameter(param, f"the response would hold {entries} logprob entries (prompts x n x tokens x "
                                          f"(logprobs + 1)); this server returns at most {self.max_logprob_entries} "
                                          "in one response (--max-logprob-entries)")


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


def bounds(low: float | None = None, high: float | None = None, *, low_open: bool = False, **more) -> dict:
    """A number's range for the OpenAPI document only: SamplingParams.check_ranges enforces it (one place,
    one message); the document must say the same, so it is written from the same constants."""
    schema: dict[str, Any] = dict(more)
    if low is not None:
        schema["exclusiveMinimum" if low_open else "minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return {"json_schema_extra": schema}


LOGIT_BIAS_KEY = r"^[0-9]{1,10}$"  # a token id written as a decimal string (JSON object keys are strings)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    # vLLM's usage in every chunk
    continuous_usage_stats: Any = refused("usage comes in one last chunk (include_usage)", FALSE)
    # OpenAI's random padding of stream chunks against length side channels: the text is the same either way
    include_obfuscation: bool | None = Field(None, description="Accepted and ignored: chunks are never padded")


class _Common(BaseModel):
    # unknown fields are kept (so that a lone surrogate anywhere is found first), then refused
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"additionalProperties": False})

    model: str | None = None
    n: int = Field(1, **bounds(1, MAX_N))
    temperature: float | None = Field(None, **bounds(0, 2))
    top_p: float | None = Field(None, **bounds(0, 1, low_open=True))
    stop: str | list[str] | None = Field(None, json_schema_extra={"maxItems": MAX_STOP_STRINGS})
    seed: int | None = Field(None, **bounds(*SEED_RANGE))
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, **bounds(-2, 2))
    frequency_penalty: float = Field(0.0, **bounds(-2, 2))
    logit_bias: dict[str, float] | None = Field(None, description=(
        "token id (a decimal string) -> a bias in [-100, 100] added to its logit before sampling, greedy "
        "included"), json_schema_extra={"propertyNames": {"pattern": LOGIT_BIAS_KEY},
                                        "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS_RANGE[0],
                                                                 "maximum": LOGIT_BIAS_RANGE[1]}})
    # an end user's id, for the operator's abuse monitoring in OpenAI's API: it asks nothing of the output
    user: str | None = Field(None, description="Accepted and ignored: it asks nothing of the output")
    # vLLM-style extensions
    top_k: int | None = Field(None, **bounds(-1))
    min_p: float | None = Field(None, **bounds(0, 1))
    repetition_penalty: float | None = Field(None, **bounds(0, 2, low_open=True))
    ignore_eos: bool = False
    min_tokens: int = Field(0, **bounds(0))
    stop_token_ids: list[int] | None = Field(None, json_schema_extra={"items": {"type": "integer", "minimum": 0}})
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, **bounds(0, MAX_LOGPROBS))  # vLLM: every prompt token's logprob, and top-k
    request_id: str | None = Field(None, max_length=128, description="vLLM's: the base of the response id")
    # Locus: the task family (code, math, chat, ...) for traces and the grouper; header X-Locus-Domain works too
    domain: str | None = Field(None, max_length=MAX_DOMAIN_CHARS)
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and structured_outputs object
    response_format: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's fields this server does not implement: only the values that ask for nothing
    guided_decoding_backend: Any = refused("the grammar engine is xgrammar, always", (None, "xgrammar", "auto"))
    guided_whitespace_pattern: Any = refused("JSON constraints are compact (no free whitespace)")
    use_beam_search: Any = refused("beam search", FALSE)
    length_penalty: Any = refused("beam search", (None, 1.0))
    allowed_token_ids: Any = refused("a token whitelist (logit_bias can favour or ban tokens)")
    bad_words: Any = refused("banned words (logit_bias can ban tokens)", EMPTY)
    truncate_prompt_tokens: Any = refused("prompt truncation (a prompt over the context is refused)")
    spaces_between_special_tokens: Any = refused("the tokenizer's decode has no such switch", (None, True))
    priority: Any = refused("priority scheduling (requests run first come, first served)", (None, 0))
    logits_processors: Any = refused("custom logits processors", EMPTY)
    return_tokens_as_token_ids: Any = refused("tokens as 'token_id:N' strings", FALSE)
    return_token_ids: Any = refused("token ids in the response", FALSE)
    cache_salt: Any = refused("per-tenant prefix caches")
    kv_transfer_params: Any = refused("KV transfer between servers")
    vllm_xargs: Any = refused("vLLM's extra arguments")

    def check_fields(self) -> None:
        """Unknown fields, and known ones asked of what this server does not do: a 400 naming it."""
        check_unknown(self)
        check_refused(self)

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not re.fullmatch(LOGIT_BIAS_KEY, key):
                raise ValueError(f"logit_bias keys are token ids written as decimal strings (\"50256\"); got {key!r}")
        return bias

    def token_bias(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {int(k): v for k, v in self.logit_bias.items()}

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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """`prompt_logprobs`: what the engine must score of the prompt (echo needs it too); default the field's."""
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
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured=self.structured_output(),
            logit_bias=self.token_bias(),
        )
        params.check_ranges()  # once, here: the engine checks only the vocabulary bounds
        return params


PromptForm = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_Common):
    prompt: PromptForm = Field(description="a text, texts, token ids, or lists of token ids (a batch); token ids "
                                           "are integers, never booleans or floats")
    max_tokens: int | None = Field(16, **bounds(0, description="0 (with echo) scores the prompt and generates nothing"))
    logprobs: int | None = Field(None, **bounds(0, 5))
    echo: bool = False
    best_of: int | None = Field(None, **bounds(1, MAX_N, description="accepted only equal to n (no candidates "
                                                                      "are ranked)"))
    add_special_tokens: bool = Field(True, description="vLLM's: the tokenizer's special tokens (BOS) before a text prompt")
    suffix: Any = refused("insertion (fill in the middle)", (None, ""))
    prompt_embeds: Any = refused("prompts as embeddings")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(describe_bad_prompt(value)) from None

    def check_unsupported(self) -> None:
        self.check_fields()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of", "best_of other than n is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise InvalidParameter("logprobs", f"logprobs must be in [0, 5] for completions, got {self.logprobs}")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameter("max_tokens", "max_tokens must be >= 1 (0 is for scoring a prompt: with echo)")

    def logprob_entries(self, prompt_lengths: list[int], max_model_len: int) -> int:
        """The logprob entries the response holds at most: each of a prompt's n choices has one per
        echoed prompt token and generated token, each with up to logprobs + 1 alternatives, and vLLM's
        prompt_logprobs (prompt_logprobs + 1 per prompt token) on every choice. Without max_tokens a
        choice may fill the context."""
        per_token = 0 if self.logprobs is None else self.logprobs + 1
        per_prompt_token = 0 if self.prompt_logprobs is None else self.prompt_logprobs + 1
        entries = 0
        for length in prompt_lengths:
            generated = self.max_tokens if self.max_tokens is not None else max(0, max_model_len - length)
            echoed = length if self.echo else 0
            entries += self.n * ((echoed + generated) * per_token + length * per_prompt_token)
        return entries

    def engine_prompt_logprobs(self) -> int | None:
        """What the engine scores of the prompt: the client's prompt_logprobs, or with echo and
        logprobs, the logprobs of every prompt token (OpenAI's and vLLM's echo); a request that
        generates nothing scores its prompt (that is all it asks the engine)."""
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):
            return max(self.logprobs or 0, self.prompt_logprobs or 0)
        return self.prompt_logprobs


def describe_bad_prompt(value: Any) -> str:
    """Why a prompt is none of the four forms, naming the first bad element."""
    if not isinstance(value, list):
        return f"the prompt must be a string, a list of strings, or token ids; it is a JSON {_json_type(value)}"
    return not_token_id(value, "prompt") or ("the prompt must be a string, a list of strings, a list of token ids "
                                             "(integers) or a list of such lists, with no mixing")


def not_token_id(ids: list, name: str) -> str | None:
    """Where a list (or a list of lists) of token ids holds a boolean or a float, said plainly (JSON's
    true and 72.0 are not token ids, though Python would take them for 1 and 72)."""
    for i, item in enumerate(ids):
        for j, token in enumerate(item if isinstance(item, list) else [item]):
            where = f"{name}[{i}][{j}]" if isinstance(item, list) else f"{name}[{i}]"
            if isinstance(token, (bool, float)):
                return f"{where} is a JSON {'boolean' if isinstance(token, bool) else 'float'}; token ids are integers"
    return None


class ChatMessage(BaseModel):
    # a message's other fields (tool_calls, ...) go to the chat template with it
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None


Messages = list[ChatMessage]


class ChatCompletionRequest(_Common):
    messages: Messages = Field(min_length=1)
    max_tokens: int | None = Field(None, **bounds(1))
    max_completion_tokens: int | None = Field(None, **bounds(1))
    logprobs: bool = False
    top_logprobs: int | None = Field(None, **bounds(0, MAX_LOGPROBS))
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(False, description="vLLM's: the tokenizer's special tokens around the rendered "
                                                        "chat (the template already has BOS)")
    # OpenAI's fields this server does not implement: only the values that ask for nothing
    tools: Any = refused("tool calling", EMPTY)
    tool_choice: Any = refused("tool calling", (None, "none"))
    functions: Any = refused("function calling (the legacy form of tools)", EMPTY)
    function_call: Any = refused("function calling (the legacy form of tools)", (None, "none"))
    # without tools there is nothing to call in parallel: any value asks for nothing
    parallel_tool_calls: bool | None = Field(None, description="Accepted: without tools it asks for nothing")
    audio: Any = refused("this model serves text only")
    modalities: Any = refused("this model serves text only", (None, ["text"]))
    prediction: Any = refused("predicted outputs")
    reasoning_effort: Any = refused("this model has no reasoning mode")
    verbosity: Any = refused("this model has no verbosity setting")
    web_search_options: Any = refused("web search")
    store: Any = refused("this server stores no completions", FALSE)
    service_tier: Any = refused("one service tier", (None, "auto", "default"))
    # OpenAI's tags for stored completions, and its hints for its own caches and abuse monitoring: they ask
    # nothing of the output (the prefix cache here needs no key)
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored: it asks nothing of the output")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored: prefix caching needs no key")
    safety_identifier: str | None = Field(None, description="Accepted and ignored: it asks nothing of the output")
    # vLLM's chat fields this server does not implement
    echo: Any = refused("echoing the last message", FALSE)
    continue_final_message: Any = refused("continuing the last message", FALSE)
    documents: Any = refused("documents for retrieval templates")
    chat_template: Any = refused("a chat template per request (the server's is --chat-template)")
    chat_template_kwargs: Any = refused("chat template arguments", (None, {}))
    mm_processor_kwargs: Any = refused("this model serves text only")

    def check_unsupported(self) -> None:
        self.check_fields()
        check_messages(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise InvalidParameter("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        for name in ("max_tokens", "max_completion_tokens"):
            if getattr(self, name) == 0:
                raise InvalidParameter(name, f"{name} must be >= 1")

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = Field(False, description="vLLM's: each token's text too")
    continue_final_message: Any = refused("continuing the last message", FALSE)
    chat_template: Any = refused("a chat template per request (the server's is --chat-template)")
    chat_template_kwargs: Any = refused("chat template arguments", (None, {}))
    tools: Any = refused("tool calling", EMPTY)
    mm_processor_kwargs: Any = refused("this model serves text only")

    def check_unsupported(self) -> None:
        check_refused(self)
        if (self.prompt is None) == (self.messages is None):
            raise InvalidParameter("prompt", "give exactly one of prompt or messages")
        if self.messages is not None:
            check_messages(self.messages)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="wrap")
    @classmethod
    def _tokens(cls, value: Any, handler):
        try:
            return handler(value)
        except ValidationError as exc:
            why = not_token_id(value, "tokens") if isinstance(value, list) else None
            if why is None:
                raise exc from None
            raise ValueError(why) from None


class TraceStartRequest(BaseModel):
    """POST /traces/start: `path` names a trace inside the server's --trace-dir (letters, digits, '.', '_',
    '-'; no path separators), default <model>-<time>."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # the name's rule is checked by routes/traces.py's trace_path (its 400 says what a name may hold); the document shows it
    path: str | None = Field(None, max_length=128, json_schema_extra={"pattern": r"^([A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$", "description": "a trace name inside --trace-dir; null or \"\" for <model>-<time>"})
