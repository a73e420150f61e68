"""Offline batch generation: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools

from locus.engine.frontend.build import build_engine
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.core.outputs import RequestOutput
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.checkpoint.tokenizer import Tokenizer


class LLM:
    """Runs many prompts through the continuous-batching engine and returns the finished outputs in order."""

    def __init__(self, model: str | None = None, *, dtype: str | None = None, device: str | None = None,
                 moe_backend: str = "auto", engine_config: EngineConfig | None = None, seed: int = 0,
                 quantize_experts: str | None = None):
        """quantize_experts: hold the routed experts in fp8, mxfp8 or mxfp4 (docs/formats.md)."""
        built = build_engine(model, dtype=dtype, device=device, moe_backend=moe_backend, seed=seed,
                             engine_config=engine_config, quantize_experts=quantize_experts)
        self.name, self.random_weights = built.loaded.name, built.loaded.random_weights
        self.engine = built.core
        self._ids = itertools.count()

    @classmethod
    def from_model(cls, model: Llama4ForCausalLM, tokenizer: Tokenizer, engine_config: EngineConfig | None = None) -> "LLM":
        self = cls.__new__(cls)
        self.name, self.random_weights = "custom", False
        self.engine = EngineCore(model, tokenizer, engine_config)
        self._ids = itertools.count()
        return self

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are strings (tokenized here) or token-id lists. One params for all, or one each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params_list):
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, tokens, p)
            ids.append(request_id)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error is not None:
                    for request_id in ids:  # leave the engine clean for the next call
                        self.engine.abort(request_id)
                    raise out.error
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
