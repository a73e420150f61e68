"""The scoring API's layout, in process (no server): `echo` with `logprobs` is the engine's prompt
logprobs then the output's, whole and streamed; /tokenizer_info is what lm-eval's remote tokenizer reads."""

from __future__ import annotations

import json

import pytest

from locus.engine.checkpoint.tokenizer import ByteTokenizer, load_tokenizer, render_chat_template
from locus.engine.frontend.llm import LLM
from locus.engine.checkpoint.loader import SHIPPED
from locus.server.protocol import CompletionRequest
from locus.server.responses import CompletionFormat, Usage
from locus.server.scoring import tokenizer_info


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def request_for(body: dict):
    request = CompletionRequest.model_validate(body)
    request.check_unsupported()
    return request


def run(llm, body: dict):
    """What /v1/completions does with `body`, without HTTP: the engine's outputs, whole and per step."""
    request = request_for(body)
    tok = llm.tokenizer
    from locus.server.responses import completion_prompts

    prompts = completion_prompts(request.prompt, tok, request.add_special_tokens)
    params = request.sampling_params(request.max_tokens, request.logprobs, request.engine_prompt_logprobs())
    core = llm.engine
    steps = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    while core.has_unfinished():
        for out in core.step():
            steps[int(out.request_id[1:])].append(out)
    return request, prompts, steps


def fmt_for(llm, request):
    return CompletionFormat.for_request("tiny", llm.tokenizer, request)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_layout_is_the_prompt_logprobs_then_the_output(llm, max_tokens):
    text = "The cat sat"
    request, prompts, steps = run(llm, {"prompt": text, "max_tokens": max_tokens, "echo": True, "logprobs": 2,
                                        "temperature": 0})
    final = steps[0][-1]
    body = fmt_for(llm, request).full_response("cmpl-x", [final], 1)
    choice = body["choices"][0]
    generated = final.outputs[0]
    assert choice["text"] == text + generated.text and len(generated.token_ids) == max_tokens
    lp = choice["logprobs"]
    ids = prompts[0] + generated.token_ids
    fmt = fmt_for(llm, request)
    assert lp["tokens"] == [fmt.token_text(t) for t in ids]
    # the prompt's entries are its prompt_logprobs: the first token has nothing before it
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t, entry in enumerate(final.prompt_logprobs[1:], start=1):
        assert lp["token_logprobs"][t] == entry.logprob
        top = lp["top_logprobs"][t]
        assert top[fmt.token_text(prompts[0][t])] == entry.logprob  # the token itself, as OpenAI's
        assert {fmt.token_text(i): v for i, v in entry.top[:2]}.items() <= top.items() and len(top) <= 3
    for k, entry in enumerate(generated.logprobs or []):
        assert lp["token_logprobs"][len(prompts[0]) + k] == entry.logprob
    # the BOS takes no room in the echoed text, which is the client's (issue 55, finding 4)
    assert lp["text_offset"] == [0] + list(range(len(ids) - 1))
    assert "prompt_logprobs" not in choice  # the client did not ask for vLLM's own field
    assert body["usage"] == {"prompt_tokens": len(prompts[0]), "completion_tokens": max_tokens,
                             "total_tokens": len(prompts[0]) + max_tokens}


def test_streamed_echo_concatenates_to_the_whole_response(llm):
    """Streamed, each choice's first chunk carries its prompt (text and logprobs); the chunks add up
    to the whole response, for a batch of token-id prompts with n = 2."""
    body = {"prompt": [[1, 2, 3, 4], [5, 6]], "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0, "n": 2}
    request, prompts, steps = run(llm, body)
    whole = fmt_for(llm, request).full_response("cmpl-x", [steps[0][-1], steps[1][-1]], 2)
    stream_fmt, usage = fmt_for(llm, request), Usage()
    chunks = []
    for i in (0, 1):
        for out in steps[i]:
            for frame in stream_fmt.stream_chunk("cmpl-x", i, 2, out, usage):
                chunks += json.loads(frame.removeprefix("data: "))["choices"]
    for choice in whole["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert choice["text"].startswith(llm.tokenizer.decode(prompts[choice["index"] // 2], skip_special_tokens=False))
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [v for c in mine for v in c["logprobs"][key]] == choice["logprobs"][key], key


def test_a_whole_response_written_in_parts_is_the_same_bytes(llm):
    """Scoring responses are built and written choice by choice (json_chunks): the bytes Starlette's
    JSONResponse writes for the whole body, vLLM's prompt_logprobs on every choice included."""
    from fastapi.responses import JSONResponse

    body = {"prompt": ["héllo", "wörld"], "max_tokens": 2, "echo": True, "logprobs": 2, "temperature": 0, "n": 3,
            "prompt_logprobs": 1}
    request, _, steps = run(llm, body)
    finals = [steps[0][-1], steps[1][-1]]
    parts = list(fmt_for(llm, request).json_chunks("cmpl-x", finals, 3))
    assert len(parts) == 2 + 6  # the head, one part per choice, the tail
    assert b"".join(parts) == JSONResponse(fmt_for(llm, request).full_response("cmpl-x", finals, 3)).body


def test_streamed_echo_with_no_output_is_one_chunk_with_the_prompt(llm):
    request, prompts, steps = run(llm, {"prompt": "abc", "max_tokens": 0, "echo": True, "stream": True})
    assert len(steps[0]) == 1 and steps[0][0].finished
    frames = fmt_for(llm, request).stream_chunk("cmpl-x", 0, 1, steps[0][0], Usage())
    [choice] = json.loads(frames[0].removeprefix("data: "))["choices"]
    assert (choice["text"], choice["logprobs"], choice["finish_reason"]) == ("abc", None, "length")


def test_logprobs_include_the_chosen_token_as_openai_does(llm):
    """OpenAI's top_logprobs hold the chosen token besides the `logprobs` best: up to logprobs + 1."""
    request, _, steps = run(llm, {"prompt": "abc", "max_tokens": 6, "logprobs": 1, "temperature": 1.0, "seed": 3})
    lp = fmt_for(llm, request).full_response("cmpl-x", [steps[0][-1]], 1)["choices"][0]["logprobs"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and 1 <= len(top) <= 2


def test_the_byte_tokenizers_chat_template_is_its_built_in_format():
    tok = ByteTokenizer()
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                               {"type": "text", "text": "b"}]}],
                     [{"role": "assistant", "content": None}]):
        for generation in (True, False):
            assert render_chat_template(ByteTokenizer.CHAT_TEMPLATE, messages, generation, bos_token="<|begin_of_text|>",
                                        eos_token="<|eot|>") == tok.apply_chat_template(messages, generation)


def test_tokenizer_info_is_the_tokenizer_config_as_vllm_serves_it():
    mini = SHIPPED["mini"]
    tok = load_tokenizer(mini, 4096)
    info = tokenizer_info(tok, 2048)
    config = json.loads((mini / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == config["tokenizer_class"] and info["eos_token"] == "<|eot|>"
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 2048
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    # lm-eval's remote tokenizer: eos_token_id = the first id /tokenize gives for eos_token, unadorned
    assert tok.encode(info["eos_token"], add_special_tokens=False) == list(tok.eos_token_ids)
    byte = tokenizer_info(ByteTokenizer(), 64)
    assert byte["eos_token"] == "<|eot|>" and byte["chat_template"] == ByteTokenizer.CHAT_TEMPLATE


# ---------------------------------------------------------------- text_offset (issue 55, finding 4)

# mini's byte-level BPE has no merges for most of these characters: they are split over byte pieces,
# which token_text names `token_id:N`
NON_ASCII = "Grüße aus Köln: 東京 café — ☕😀!"


@pytest.fixture(scope="module")
def mini():
    return LLM("mini")


def pieces_by_decoding(tok, ids: list[int], skip_special_tokens: bool, context: list[int] = ()) -> list[str]:
    """Each token's piece of the text, by definition: what decoding the tokens up to it adds to
    decoding those before it (after `context`), a character whose bytes are not all there yet
    counted with the token that completes it."""
    def text(k: int) -> str:
        return tok.decode(list(context) + ids[:k], skip_special_tokens=skip_special_tokens).rstrip("\ufffd")

    head = text(0)
    texts = [text(k)[len(head):] for k in range(len(ids) + 1)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    return [b[len(a):] for a, b in zip(texts, texts[1:])]


def pieces_at_offsets(choice: dict) -> list[str]:
    text, offsets = choice["text"], choice["logprobs"]["text_offset"]
    return [text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])]


@pytest.mark.parametrize("prompt", [NON_ASCII, ["plain text", NON_ASCII], "token ids", "token ids with BOS"],
                         ids=["text", "texts", "token-ids", "token-ids-with-bos"])
@pytest.mark.parametrize("max_tokens", [0, 5])
def test_text_offset_indexes_the_echoed_text(mini, prompt, max_tokens):
    """text[offset_i:offset_i+1] is token i's piece of the choice's text, byte pieces included: the
    offsets counted the BOS a text prompt's echo does not hold (17 characters) and the 12 characters
    of `token_id:N` for each byte piece."""
    tok = mini.tokenizer
    if prompt in ("token ids", "token ids with BOS"):
        ids = tok.encode(NON_ASCII, add_special_tokens=prompt == "token ids with BOS")
        prompt = [ids, ids[:7]]
    request, prompts, steps = run(mini, {"prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 2,
                                         "temperature": 0, "n": 2})
    text_prompt = isinstance(request.prompt[0], str)
    body = fmt_for(mini, request).full_response("cmpl-x", [steps[i][-1] for i in steps], 2)
    assert any(t.startswith("token_id:") for choice in body["choices"] for t in choice["logprobs"]["tokens"])
    for choice in body["choices"]:
        i = choice["index"] // 2
        generated = steps[i][-1].outputs[choice["index"] % 2].token_ids
        # a text prompt's echo is the client's text (its BOS is not there); token ids echo their decoding
        expected = (pieces_by_decoding(tok, prompts[i], skip_special_tokens=text_prompt)
                    + pieces_by_decoding(tok, generated, True, context=prompts[i]))
        assert "".join(expected) == choice["text"]
        assert pieces_at_offsets(choice) == expected


def test_text_offset_of_generated_tokens_alone_and_streamed(mini):
    """Without echo the offsets index the generated text from 0; streamed, they continue across chunks."""
    tok = mini.tokenizer
    body = {"prompt": NON_ASCII, "max_tokens": 8, "logprobs": 1, "temperature": 0}
    request, prompts, steps = run(mini, body)
    [choice] = fmt_for(mini, request).full_response("cmpl-x", [steps[0][-1]], 1)["choices"]
    assert pieces_at_offsets(choice) == pieces_by_decoding(tok, steps[0][-1].outputs[0].token_ids, True, prompts[0])
    request, prompts, steps = run(mini, {**body, "echo": True, "stream": True})
    stream_fmt, offsets, text = fmt_for(mini, request), [], ""
    for out in steps[0]:
        for frame in stream_fmt.stream_chunk("cmpl-x", 0, 1, out, Usage()):
            [chunk] = json.loads(frame.removeprefix("data: "))["choices"]
            text += chunk["text"]
            offsets += chunk["logprobs"]["text_offset"]
    whole = fmt_for(mini, request).full_response("cmpl-x", [steps[0][-1]], 1)["choices"][0]
    assert (text, offsets) == (whole["text"], whole["logprobs"]["text_offset"])
    assert pieces_at_offsets(whole)[:len(prompts[0])] == pieces_by_decoding(tok, prompts[0], True)

