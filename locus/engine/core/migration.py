"""A running request taken out of one engine and put into another with its KV cache: how an
expert-parallel server moves a request after its prefill (docs/planner.md, "Moving a request after
prefill"). The engines' ranks carry the two halves over the wire (locus/engine/ep/ranks/worker.py).

    take_out(core, request_id) -> Migrant       the source: the sequence leaves its scheduler (as a
                                                preemption that keeps its KV rows), its blocks go back
    take_in(core, migrant) -> bool              the target: blocks for the rows, the rows written, the
                                                sequence rebuilt and scheduled like a running one

What travels: every attention layer's cache rows of the computed positions (payload only,
`kv [layers, T, W]`: each position's key row then its value row, flattened, so a family whose cache
holds other rows, DeepSeek's latent and rotated key, moves the same way), and the sampler state:
output ids, logprobs, the seeded generator's state, prompt logprobs, and the recorder's partial rows. The detokenizer and the stop-string scanner
are rebuilt on the target from the output ids (as a resumed request's are: deterministic), so the
request's text, ids and greedy tokens are the ones it would have had without the move. Requests with
n > 1 (sequences sharing blocks) or an output grammar (xgrammar matcher state) never move.

Shape legend: T positions moved, W the cache values one position holds in a layer (2 x KV heads x
head dim, or DeepSeek's kv_lora_rank + qk_rope_head_dim).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from locus.engine.sampling.sampler import SamplingParams, TokenLogprob
from locus.engine.requests.sequence import Request, Resumed, SequenceStatus

log = logging.getLogger("locus.engine")


@dataclass
class Migrant:
    """A request on its way from one engine to another."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # as the source resolved them (max_tokens set)
    domain: str | None
    output_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    generator_state: torch.Tensor | None = None  # a seeded request's torch.Generator state
    prompt_logprobs: list | None = None
    trace: object | None = None  # the source recorder's rows of it (trace_recorder._SeqTrace), when recording
    kv: torch.Tensor | None = None  # [layers, T, W]: the cache rows of its first T positions
    queued: float | None = None  # seconds it waited on the source before it first ran (clocks differ per host)
    num_cached_tokens: int | None = None  # what the source's prefix cache served of its prompt

    @property
    def kv_tokens(self) -> int:
        return 0 if self.kv is None else int(self.kv.shape[1])

    def state(self) -> "Migrant":
        """Everything but the KV rows (what is pickled; the rows travel as a tensor)."""
        return Migrant(self.request_id, self.prompt_ids, self.params, self.domain, self.output_ids, self.logprobs,
                       self.generator_state, self.prompt_logprobs, self.trace, None, self.queued,
                       self.num_cached_tokens)


def why_not_movable(request: Request) -> str | None:
    """Why a request cannot move (None: it can)."""
    if request.params.n != 1:
        return f"it has n = {request.params.n} sequences"
    if request.params.structured is not None:
        return "its output follows a grammar"
    if request.finished or not request.seqs:
        return "it has finished"
    return None


def kv_width(core) -> int:
    """W: the cache values one position holds in one layer, its key row and its value row."""
    cache = core.cache
    return cache.keys[0][0].numel() + cache.values[0][0].numel()


def kv_shape(core, tokens: int) -> tuple[int, int, int]:
    """The shape of a migrant's `kv` of `tokens` positions on `core`'s cache (what a target receives)."""
    return len(core.cache.keys), tokens, kv_width(core)


def kv_bytes_per_token(core) -> int:
    """KV cache bytes one token occupies on `core`'s cache, all layers: what a move sends per position."""
    return len(core.cache.keys) * kv_width(core) * core.cache.keys[0].element_size()


def _rows(core, block_table: list[int], tokens: int) -> torch.Tensor:
    """Flat cache rows of positions 0..tokens-1 of a sequence with `block_table`."""
    bs = core.cache.block_size
    positions = torch.arange(tokens, device=core.cache.keys[0].device)
    table = torch.tensor(block_table, dtype=torch.long, device=positions.device)
    return table[positions // bs] * bs + positions % bs


def take_out(core, request_id: str) -> Migrant | None:
    """Remove `request_id` from `core` without finishing it and return what the target needs; None
    when `core` does not hold it (it finished or was aborted before the move reached it). Raises
    ValueError for a request that cannot move (rank 0 never asks for one)."""
    request = core.requests.get(request_id)
    if request is None:
        return None
    reason = why_not_movable(request)
    if reason is not None:
        raise ValueError(f"request {request_id!r} cannot move: {reason}")
    seq = request.seqs[0]
    kv = None
    if seq.status is SequenceStatus.RUNNING and seq.num_computed > 0:
        rows = _rows(core, seq.block_table, seq.num_computed)
        cache = core.cache
        kv = torch.stack([torch.cat([k[rows].flatten(1), v[rows].flatten(1)], dim=1)
                          for k, v in zip(cache.keys, cache.values)])
    trace = core.recorder.hand_over(seq) if core.recorder is not None else None
    generator = seq.sampling.generator
    metrics = request.metrics
    queued = None if metrics.first_scheduled_time is None else metrics.first_scheduled_time - metrics.arrival_time
    migrant = Migrant(request_id, list(request.prompt_ids), request.params, request.domain, list(seq.output_ids),
                      list(seq.logprobs), generator.get_state() if generator is not None else None,
                      request.prompt_logprobs, trace, kv, queued, request.num_cached_tokens)
    core.scheduler.finish(seq)  # its blocks go back; the recorder was handed its rows above
    del core.requests[request_id]
    return migrant


def take_in(core, migrant: Migrant) -> bool:
    """Rebuild `migrant` in `core`: its KV rows in newly allocated blocks, running; or, when the pool
    has no room for them (or no sequence slot is free), waiting, to be recomputed from its tokens like
    a preempted sequence. Returns whether its KV rows were kept."""
    params = migrant.params
    request = Request(migrant.request_id, list(migrant.prompt_ids), params, migrant.domain, forked=True,
                      num_cached_tokens=migrant.num_cached_tokens)
    seq = core._new_sequence(request, 0)
    request.seqs.append(seq)
    core._resume(seq, Resumed(list(migrant.output_ids), list(migrant.logprobs)))
    if migrant.generator_state is not None:
        seq.sampling.generator.set_state(migrant.generator_state)
    if migrant.queued is not None:
        request.metrics.first_scheduled_time = request.metrics.arrival_time + migrant.queued
    if migrant.prompt_logprobs is not None:  # the source sent them with the request's first output
        request.prompt_logprobs, request.prompt_logprobs_reported = list(migrant.prompt_logprobs), True
    if migrant.trace is not None and core.recorder is not None:
        core.recorder.adopt(seq, migrant.trace)
    scheduler, blocks = core.scheduler, core.blocks
    tokens = migrant.kv_tokens
    kept = (0 < tokens < seq.num_tokens and blocks.blocks_for(tokens) <= blocks.num_free_blocks
            and len(scheduler.running) < scheduler.config.max_num_seqs)
    if kept:
        seq.block_table = [blocks.allocate() for _ in range(blocks.blocks_for(tokens))]
        rows = _rows(core, seq.block_table, tokens)
        kv = migrant.kv.to(core.cache.keys[0].device)
        for layer, (k, v) in enumerate(zip(core.cache.keys, core.cache.values)):
            split = k[0].numel()
            k[rows] = kv[layer, :, :split].reshape(tokens, *k.shape[1:]).to(k.dtype)
            v[rows] = kv[layer, :, split:].reshape(tokens, *v.shape[1:]).to(v.dtype)
        seq.num_computed = tokens
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = scheduler._next_admission()
        scheduler.running.append(seq)
    else:
        if tokens:
            log.info("request %s moved in without room for its %d KV positions: it is recomputed here",
                     migrant.request_id, tokens)
        scheduler.add(seq)
    core.requests[migrant.request_id] = request
    return kept
