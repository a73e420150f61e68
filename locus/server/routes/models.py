"""The model and its tokenizer: GET /v1/models, GET /tokenizer_info, POST /tokenize, POST /detokenize."""

from __future__ import annotations

from fastapi import APIRouter

from locus.engine.sampling.sampler import InvalidParameter
from locus.server import scoring
from locus.server.prompts import check_text_size, off_loop_if_large, text_chars
from locus.server.protocol import DetokenizeRequest, TokenizeRequest
from locus.server.state import ServerState, reject_lone_surrogates


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    config = state.config

    @router.get("/v1/models")
    async def models():
        engine = state.engine
        max_len = engine.info.max_model_len if engine else None
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "locus", "root": config.model or "tiny", "max_model_len": max_len}]}

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        engine = state.ready_engine()
        return scoring.tokenizer_info(engine.info.tokenizer, engine.info.max_model_len)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        engine = state.accept(body)
        info = engine.info
        tok = info.tokenizer
        # the completion endpoints' limits: a text that cannot fit the context is refused untokenized,
        # a large one is tokenized off the event loop
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            chars = text_chars(messages)
            check_text_size(chars, tok, info.max_model_len, "messages")
            ids = await off_loop_if_large(chars, lambda: tok.encode(
                tok.apply_chat_template(messages, body.add_generation_prompt), add_special_tokens=False))
        else:
            chars = len(body.prompt)
            check_text_size(chars, tok, info.max_model_len, "prompt")
            ids = await off_loop_if_large(chars, lambda: tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        answer = {"tokens": ids, "count": len(ids), "max_model_len": info.max_model_len}
        if body.return_token_strs:
            answer["token_strs"] = scoring.token_strings(tok, ids)
        return answer

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        engine = state.ready_engine()
        reject_lone_surrogates(body)
        state.check_model(body.model)
        info = engine.info
        vocab, limit = info.vocab_size, info.max_model_len
        if len(body.tokens) > limit:  # no prompt or output of this model is longer
            raise InvalidParameter("tokens", f"{len(body.tokens)} tokens; this model's context limit is {limit}")
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter("tokens", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        text = await off_loop_if_large(len(body.tokens) * 4, lambda: info.tokenizer.decode(body.tokens))
        return {"prompt": text}

    return router
