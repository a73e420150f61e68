"""The engine loop: schedule -> run -> sample -> postprocess, one step at a time.

`EngineCore` is single-threaded; `LLM` (offline) drives it in a loop and `AsyncEngine` (serving)
drives it from a background thread. A step is two halves, `launch` (schedule, queue the device work
and the step's one readback) and `finish` (append the tokens, outputs); `step` runs them
serially or overlapped, the host finishing step N while the device runs N + 1 (launched_step.py).

Failures: an exception in the per-request parts of a step (sampling a row with the request's own
parameters, detokenizing and stop-checking its token) fails that request alone: it finishes with
finish_reason "error" and `RequestOutput.error` set, its blocks go back, and the step goes on for
the others. An exception anywhere else (the forward, the scheduler) propagates: the caller decides
that the engine is dead.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from locus.engine.core.block_manager import BlockManager
from locus.engine.runner.decode_graph import DecodeGraphs, default_buckets
from locus.engine.core.detokenizer import IncrementalDetokenizer
from locus.engine.observers.expert_load import ExpertLoadCounter
from locus.engine.sampling.grammar_limits import GrammarLimits
from locus.engine.policies.grouping import GroupingPolicy
from locus.engine.requests.sequence import Request, Resumed, ScheduledSeq, Sequence, SequenceStatus
from locus.engine.model.kv_cache import PagedKVCache
from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.engine.observers.routing_tap import RoutingTap
from locus.engine.host_transfer import Readback, to_device
from locus.engine.sampling.logprobs import describe, logprob_tensors
from locus.engine.runner.model_runner import Feed, ModelRunner, PromptLogits, RunResult
from locus.engine.sampling.sampler import InvalidParameter, Sampler, SamplingParams, SequenceSamplingState
from locus.engine.core.launched_step import LaunchedBatch, LaunchedSample, LaunchedStep
from locus.engine.sampling.grammar import JSON_KINDS, ConstraintDeadEnd, GrammarCompiler
from locus.engine.core.scheduler import Scheduler, SchedulerConfig
from locus.engine.checkpoint.tokenizer import Tokenizer
from locus.engine.observers.trace_recorder import RecordingSummary, TraceRecorder
from locus.errors import LocusError
from locus.flags import parse_memory  # noqa: F401 - its home before the flags' checks moved out of torch's reach
from locus.kernels import resolve_backend

GiB = 1 << 30
log = logging.getLogger("locus.engine")


class Lockstep(Protocol):
    def run_forwards(self, micro_batches: list[list[ScheduledSeq]], forward: Callable[[list[ScheduledSeq]], RunResult]) -> list[RunResult]:
        """Run this rank's micro-batches as the step's forwards, in lockstep with the other ranks:
        as many forwards as they run (idle ones where this rank has fewer), in the same order."""


class RequestFailedError(LocusError):
    """The engine failed one request while serving it (the others go on)."""


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_memory: int = 1 * GiB  # bytes for the KV pool (all layers, keys and values)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    num_micro_batches: int = 1
    count_expert_load: bool = True  # per-layer expert token counters (for /metrics); costs a bincount per layer
    # Decode graphs (runner/decode_graph.py): pure decode batches run one forward per batch-size bucket, padded
    # to the smallest bucket that holds them; buckets None = 1, 2, 4, ... up to max_num_seqs.
    # On CUDA each bucket is captured as a CUDA graph unless enforce_eager (as vLLM's --enforce-eager);
    # compile_decode torch.compiles the forward (CPU: called; CUDA: what gets captured).
    compile_decode: bool = False
    compile_buckets: tuple[int, ...] | None = None
    enforce_eager: bool = False
    # The overlapped schedule (launched_step.py): the host finishes step N while the device runs N + 1.
    # None = off: the overlap has not yet measured faster on any device (docs/engine.md).
    async_scheduling: bool | None = None
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # output constraints' budgets


@dataclass
class EngineStats:
    num_running: int  # requests with a sequence holding KV blocks
    num_waiting: int  # requests not yet (or no longer) holding blocks
    kv_usage: float  # share of KV blocks in use
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_chunked_prefills: int
    prompt_tokens: int  # prompt tokens of admitted requests
    generation_tokens: int  # tokens sampled
    prefix_cache_queries: int  # full prompt blocks looked up
    prefix_cache_hits: int  # of which reused


@dataclass(frozen=True)
class ValidatedRequest:
    """A prompt and its sampling parameters as `EngineCore.validate` passed them: the engine's one check of
    a request. `admit` and the backends' `add` take it without checking again."""

    prompt_ids: list[int]
    params: SamplingParams


def experts_capturable(model: Llama4ForCausalLM) -> bool:
    """Whether every MoE block's experts run without asking the host anything (the Triton kernels on
    float weights; quantized weights still take the reference on CUDA): what a CUDA graph capture needs."""
    return all(resolve_backend(layer.feed_forward.moe_backend, model.device) == "triton"
               and layer.feed_forward.experts.weight_format is None
               for layer in model.model.layers if layer.is_moe)


class EngineCore:
    def __init__(self, model: Llama4ForCausalLM, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 grouping: GroupingPolicy | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        mc = model.config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        num_blocks = config.num_kv_blocks or config.kv_cache_memory // PagedKVCache.bytes_per_block(mc, config.block_size, model.dtype)
        if num_blocks < 1:
            raise LocusError(f"KV cache memory {config.kv_cache_memory} bytes holds no block of {config.block_size} tokens")
        self.cache = PagedKVCache(mc, num_blocks, config.block_size, model.dtype, model.device)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                                config.num_micro_batches), grouping)
        self.graphs = self._decode_graphs(model, config)
        self.runner = ModelRunner(model, self.cache, self.graphs)
        self.sampler = Sampler(tokenizer.eos_token_ids or mc.eos_token_ids, tokenizer.eos_token_id)
        self.overlap = bool(config.async_scheduling)  # the configured choice; `overlapping` says if it applies
        self.in_flight: LaunchedStep | None = None  # overlapped: the step launched and not yet finished
        self.step_wait_seconds = 0.0  # time the host spent blocked on readbacks (the device was still busy)
        self.grammars = GrammarCompiler(tokenizer, mc.vocab_size, config.grammar_limits)  # compiled on first use
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.prompt_tokens = self.generation_tokens = 0
        # Routing is recorded only while someone subscribes: the /metrics counters, the trace
        # recorder, a plan's grouper (subscribe with self.routing.subscribe).
        self.routing = RoutingTap(tuple(mc.moe_layers))
        self.recorder: TraceRecorder | None = None
        self.recording_failures = 0  # recordings stopped by an error (a full disk, say), for /metrics
        # Expert parallelism (set by whoever applied it): run as many forwards as the other ranks,
        # taking part in their exchanges when this rank has fewer micro-batches (ep/runtime.py).
        self.lockstep: Lockstep | None = None
        self.expert_load: ExpertLoadCounter | None = None
        if config.count_expert_load and mc.moe_layers:
            self.expert_load = ExpertLoadCounter(mc.moe_layers, mc.num_local_experts)
            self.routing.subscribe(self.expert_load)

    def _decode_graphs(self, model: Llama4ForCausalLM, config: EngineConfig) -> DecodeGraphs | None:
        """The decode graphs this configuration asks for (None: every step eager), compiled and
        captured now."""
        capture = model.device.type == "cuda" and not config.enforce_eager
        why_not = None
        if capture and getattr(model, "expert_parallel", None) is not None:
            why_not = "expert parallelism's exchange is not captured"
        elif capture and not experts_capturable(model):
            why_not = ("the experts run the torch reference, which counts each expert's rows on the host "
                       "(--moe-backend torch, or quantized expert weights)")
        if why_not is not None:  # docs/engine.md, "Decode graphs"
            capture = False
            log.info("decode steps are not captured as CUDA graphs: %s%s", why_not,
                     "" if config.compile_decode else "; they run eagerly")
        if not (capture or config.compile_decode):
            return None
        buckets = [b for b in config.compile_buckets or default_buckets(config.max_num_seqs) if b <= config.max_num_seqs]
        if not buckets:
            raise LocusError(f"no decode bucket ({config.compile_buckets}) is at most max_num_seqs ({config.max_num_seqs})")
        max_blocks = -(-min(self.max_model_len, self.pool_tokens) // config.block_size)
        graphs = DecodeGraphs(model, self.cache, buckets, max_blocks, compile=config.compile_decode, capture=capture)
        graphs.warm_up()
        return graphs

    @property
    def compile_seconds(self) -> float:
        """Seconds the decode graphs took to compile and capture at start-up (0 without them)."""
        return sum(self.graphs.compile_seconds.values()) if self.graphs is not None else 0.0

    # --- requests -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> ValidatedRequest:
        """The one check of a request against this engine (its sampling fields against the vocabulary, its
        constraint, its prompt against the vocabulary, the context and the KV pool): InvalidParameter/LocusError
        for one that can never run, else the request as `admit` takes it. The engine keeps nothing. The
        sampling ranges were checked where the request entered (`ranges_checked`); params an offline caller
        built itself have them checked here."""
        if not params.ranges_checked:
            params.check_ranges()
        params.check_vocab(self.model.config.vocab_size)
        if params.structured is not None:  # a spec that does not compile, or that no output meets, is a 400
            self.grammars.check_satisfiable(params.structured)
        if not prompt_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter("prompt", f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        limit = self.max_model_len
        generated = 1 if params.generates else 0  # a request that only scores its prompt needs no room for a token
        if len(prompt_ids) + generated > limit:
            raise InvalidParameter("prompt", f"the prompt has {len(prompt_ids)} tokens; this model's context limit is {limit} tokens"
                                             + (", including at least one generated" if generated else ""))
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > limit:
            raise InvalidParameter("max_tokens", f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds this model's context limit of {limit} tokens")
        # A sequence must fit the whole pool on its own: one that cannot would preempt itself and
        # wait for room forever.
        pool_tokens = self.pool_tokens
        if len(prompt_ids) + generated > pool_tokens:
            raise InvalidParameter("prompt", f"the prompt has {len(prompt_ids)} tokens but the KV cache holds only {pool_tokens}")
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > pool_tokens:
            raise InvalidParameter("max_tokens", f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the {pool_tokens} tokens the KV cache holds")
        return ValidatedRequest(list(prompt_ids), params)

    @property
    def pool_tokens(self) -> int:
        return self.blocks.num_blocks * self.blocks.block_size

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, domain: str | None = None,
                    resumed: Resumed | None = None) -> Request:
        """Validate the request and add it (offline callers; the server validates at admission and calls
        `admit`). resumed: output already streamed elsewhere, taken as this request's first tokens (n = 1 only)."""
        if request_id in self.requests:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        return self.admit(request_id, self.validate(prompt_ids, params), domain, resumed)

    def admit(self, request_id: str, request: ValidatedRequest, domain: str | None = None,
              resumed: Resumed | None = None) -> Request:
        """Add a request `validate` passed, without checking it again."""
        if request_id in self.requests:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        prompt_ids, params = request.prompt_ids, request.params
        if resumed is not None and params.n != 1:
            raise InvalidParameter("n", "only a request with n = 1 can resume from streamed output")
        if params.max_tokens is None:  # up to the context limit (or what the KV pool holds, if less)
            params = SamplingParams(**{**params.__dict__, "max_tokens": min(self.max_model_len, self.pool_tokens) - len(prompt_ids)})
        request = Request(request_id, list(prompt_ids), params, domain, forked=params.n == 1)
        request.seqs.append(self._new_sequence(request, 0))
        if resumed is not None:
            self._resume(request.seqs[0], resumed)
        self.scheduler.add(request.seqs[0])
        self.requests[request_id] = request
        self.prompt_tokens += len(prompt_ids)
        return request

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        state = SequenceSamplingState.create(request.params, request.prompt_ids, index)
        if request.params.structured is not None:
            state.grammar = self.grammars.matcher(request.params.structured)
            if request.params.structured.kind in JSON_KINDS:
                state.json_guard = self.grammars.json_guard()
        return Sequence(next(self._seq_ids), request, index, state,
                        IncrementalDetokenizer(self.tokenizer, request.prompt_ids, request.params))

    def _resume(self, seq: Sequence, resumed: Resumed) -> None:
        """Replay streamed tokens through everything a sampled token passes (grammar, detokenizer), but
        report none of them again: they are output the client already has."""
        state = seq.sampling
        for token in resumed.token_ids:
            if state.grammar is not None and not state.grammar.accept_token(token):
                raise InvalidParameter("resumed", f"the request's grammar rejects its own streamed token {token}")
            seq.output_ids.append(token)
            seq.detokenizer.add(token)
        seq.logprobs += resumed.logprobs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and return its KV blocks to the pool."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self._release(seq)
        request.metrics.finished_time = time.monotonic()
        return self._output(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def pending_tokens(self) -> int:
        """Tokens the unfinished sequences still have to run through the model: an upper bound on
        what the next step can schedule (expert parallelism sizes its fixed-capacity exchange by it)."""
        return sum(seq.num_uncomputed for request in self.requests.values()
                   for seq in request.seqs if not seq.is_finished)

    # --- the step -------------------------------------------------------------------------------
    @property
    def overlapping(self) -> bool:
        """Whether steps overlap: as configured, unless the engine steps in lockstep with other ranks (each
        rank's step is one collective sequence the others must meet)."""
        return self.overlap and self.lockstep is None

    def step(self) -> list[RequestOutput]:
        """One step: serially, launch and finish it; overlapped, launch the next one and finish the one
        in flight (launched_step.py says what stays exact). Returns the outputs of the steps finished."""
        outputs: list[RequestOutput] = []
        previous, self.in_flight = self.in_flight, None
        if previous is not None and (not self.overlapping or previous.needs_host_tokens()):
            outputs += self.finish(previous)  # its tokens must be on the host before the next step is scheduled
            previous = None
        launched = self.launch(previous.feed() if previous is not None else None)
        if previous is not None:
            outputs += self.finish(previous)
        if launched is not None:
            if self.overlapping:
                self.in_flight = launched
            else:
                outputs += self.finish(launched)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight, if any: afterwards every sampled token is on the host."""
        previous, self.in_flight = self.in_flight, None
        return self.finish(previous) if previous is not None else []

    def launch(self, feed: Feed | None = None) -> LaunchedStep | None:
        """Schedule a step, queue its forwards and sampling on the device and its one readback; reads
        nothing back. feed: the previous step's sampled ids, if it is still in flight. None: nothing
        to run."""
        batch = self.scheduler.schedule()
        if batch is None:
            if self.lockstep is not None:  # an idle rank still meets the others' exchanges
                self.lockstep.run_forwards([], self.runner.run)
            return None
        micro_batches = batch.micro_batches
        for src, dst in batch.block_copies:  # copy-on-write of forked sequences' shared tails
            self.cache.copy_block(src, dst)
        options = {"record_routing": self.routing.active}
        if len(micro_batches) > 1 and self.lockstep is not None:
            options["defer_logits"] = True  # micro-batches that run at once (expert parallelism) share one lm_head
        if feed is not None:
            options["feed"] = feed

        def forward(items: list[ScheduledSeq]) -> RunResult:
            return self.runner.run(items, **options)

        if self.lockstep is not None:  # every rank runs as many forwards as the others, in order
            results = self.lockstep.run_forwards(micro_batches, forward)
        else:
            results = [forward(items) for items in micro_batches]
        if "defer_logits" in options:
            self.runner.attach_logits(results)
        launched = LaunchedStep([], Readback(self.model.device))
        for items, result in zip(micro_batches, results):
            for item in items:
                item.seq.num_computed += item.num_tokens
                self._register_full_blocks(item.seq)
            part = LaunchedBatch(items, result)
            if result.routing and self.routing.active:
                part.routing = launched.readback.add(self.routing.pack(result))
            part.prompts = [(scored, self._launch_prompt_scores(scored, launched.readback))
                            for scored in result.prompt_logits]
            if result.sampled:
                part.sample = self._launch_sample(result, launched)
            launched.batches.append(part)
        launched.readback.issue()
        return launched

    def finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Wait for a launched step's readback; publish its routing, score its prompts, append its
        tokens (dropping the rows of sequences that finished meanwhile) and return the outputs."""
        arrays = launched.readback.wait()
        self.step_wait_seconds += launched.readback.wait_seconds
        touched: OrderedDict[str, Request] = OrderedDict((r.request_id, r) for r in launched.failed)
        for part in launched.batches:
            for scored, handles in part.prompts:
                self._score_prompt(scored, [arrays[h] for h in handles])
            if part.routing is not None:
                self.routing.publish(arrays[part.routing], part.items, part.result.batch)
            for item in part.items:  # a request that only scores its prompt ends with it
                seq = item.seq
                if not seq.request.params.generates and not seq.is_finished and seq.num_computed == seq.num_tokens:
                    self._finish_scored(seq, touched)
            if part.sample is not None:
                self._take_sample(part.sample, arrays, touched)
        outputs = []
        for request in touched.values():
            if self.requests.get(request.request_id) is not request:
                continue  # aborted since: abort() gave its last output
            outputs.append(self._output(request))
            if request.finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _launch_sample(self, result: RunResult, launched: LaunchedStep) -> LaunchedSample | None:
        """Queue the sampling of a micro-batch's sampled rows (an n > 1 request forks here, when its
        prompt is done: its choices sample from the parent's row)."""
        rows, seqs, forks = [], [], []
        for i, seq in enumerate(result.sampled):
            group = [seq]
            if not seq.request.forked:
                children = self._fork(seq)
                forks += [(seq, child) for child in children]
                group += children
            rows += [i] * len(group)
            seqs += group
        logits, argmax = result.logits, result.argmax
        if len(rows) != logits.shape[0]:  # n > 1 repeats rows; skip the [B, V] copy when not
            index = to_device(np.asarray(rows, dtype=np.int64), logits.device)
            logits = logits.index_select(0, index)
            argmax = None if argmax is None else argmax.index_select(0, index)
        try:
            sample = self.sampler.launch(logits, [s.sampling for s in seqs], argmax)
        except Exception as exc:  # noqa: BLE001 - find the row(s) to blame, or re-raise
            sample, seqs = self._launch_rows(logits, argmax, seqs, exc, launched.failed)
            if sample is None:
                return None
        for row in sample.dead:  # a constraint (with the stop-token mask) left the row no token at all
            request = seqs[row].request
            if request.error is None:
                self._fail(request, ConstraintDeadEnd(f"row {row}: the output constraint allows no token here"))
                launched.failed.append(request)
        for seq in seqs:
            seq.sampling.in_flight += 1
        handles = [launched.readback.add(sample.token_ids)]
        if sample.logprobs is not None:
            handles += sample.logprobs.add_to(launched.readback)
        return LaunchedSample(seqs, sample, handles, forks)

    def _launch_rows(self, logits: torch.Tensor, argmax: torch.Tensor | None, seqs: list[Sequence],
                     batch_error: Exception, failed: list[Request]):
        """The batched sampler raised: try each row alone (its generator put back after), fail the
        requests whose rows raise, and launch the others together. If every row raises, the fault is
        not the requests' and the batch's error propagates, unless each row's own constraint is what
        failed (ConstraintDeadEnd: that request's fault, always). Returns (launch or None, its seqs)."""
        good, own_fault = [], 0
        for i, seq in enumerate(seqs):
            generator = seq.sampling.generator
            saved = generator.get_state() if generator is not None else None
            try:
                self.sampler.launch(logits[i:i + 1], [seq.sampling], None if argmax is None else argmax[i:i + 1])
                good.append(i)
            except Exception as exc:  # noqa: BLE001
                own_fault += isinstance(exc, ConstraintDeadEnd)
                if seq.request.error is None:
                    self._fail(seq.request, exc)
                    failed.append(seq.request)
            finally:
                if saved is not None:
                    generator.set_state(saved)
        if not good:
            if own_fault < len(seqs):
                raise batch_error
            return None, []
        index = to_device(np.asarray(good, dtype=np.int64), logits.device)
        chosen = [seqs[i] for i in good]
        sample = self.sampler.launch(logits.index_select(0, index), [s.sampling for s in chosen],
                                     None if argmax is None else argmax.index_select(0, index))
        return sample, chosen

    def _take_sample(self, sample: LaunchedSample, arrays: list, touched: OrderedDict) -> None:
        """A launched sampling's tokens, on the host now: append each to its sequence (a sequence that
        finished since the launch drops its row)."""
        tokens = arrays[sample.handles[0]].tolist()
        launch = sample.launch
        logprobs = [None] * len(tokens) if launch.logprobs is None else \
            describe(tokens, [arrays[h] for h in sample.handles[1:]], launch.logprob_counts)
        if self.recorder is not None:  # the children's prompt rows are the parent's, published by now
            for parent, child in sample.forks:
                if not child.is_finished:
                    self.recorder.fork(parent, child)
        now = time.monotonic()
        for seq, token, logprob in zip(sample.seqs, tokens, logprobs):
            seq.sampling.in_flight -= 1
            if seq.is_finished:  # finished, aborted or failed after this step was launched
                continue
            request = seq.request
            try:
                self._append(seq, token, logprob)
            except Exception as exc:  # noqa: BLE001 - this request's own tokens or stop strings
                self._fail(request, exc)
            if not seq.is_finished:
                self._register_full_blocks(seq)  # its newest token is known now
            if request.request_id not in touched:
                touched[request.request_id] = request
                if request.error is None:
                    request.metrics.note_token(now)

    def _fail(self, request: Request, exc: Exception) -> None:
        """End one request with an error; the engine goes on with the others."""
        log.error("request %s failed; the engine goes on", request.request_id, exc_info=exc)
        request.error = RequestFailedError(f"the engine failed this request: {type(exc).__name__}: {exc}")
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
                self._release(seq)
        request.metrics.finished_time = time.monotonic()

    def _finish_scored(self, seq: Sequence, touched: OrderedDict) -> None:
        """A request that only scores its prompt (max_tokens 0) ends once its prompt is computed: it
        never samples, and its n choices are all the same empty output."""
        request = seq.request
        seq.finish_reason = "length"
        self._release(seq)
        if not request.forked:
            request.forked = True
            for index in range(1, request.params.n):
                child = self._new_sequence(request, index)
                child.status, child.finish_reason = SequenceStatus.FINISHED, "length"
                request.seqs.append(child)
        request.metrics.finished_time = time.monotonic()
        touched[request.request_id] = request

    def _launch_prompt_scores(self, scored: PromptLogits, readback: Readback) -> list[int]:
        """Queue one step's prompt logprobs (positions first.. predict tokens first + 1..) on the device."""
        request = scored.seq.request
        n = scored.logits.shape[0]
        targets = request.prompt_ids[scored.first + 1: scored.first + 1 + n]
        raw = torch.log_softmax(scored.logits.float(), dim=-1)
        ids = to_device(np.asarray(targets, dtype=np.int64), raw.device)
        return logprob_tensors(raw, ids, request.params.prompt_logprobs, ranks=True).add_to(readback)

    def _score_prompt(self, scored: PromptLogits, arrays: list) -> None:
        """Append this step's prompt logprobs (positions first.. predict tokens first + 1..)."""
        request = scored.seq.request
        if request.prompt_positions_scored != scored.first:  # a recompute of scored positions
            return
        n = scored.logits.shape[0]
        targets = request.prompt_ids[scored.first + 1: scored.first + 1 + n]
        request.prompt_logprobs += describe(targets, arrays, [request.params.prompt_logprobs] * len(targets))

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Create the other n-1 choices, each sharing all of the parent's blocks. Nothing is
        allocated or preempted here (the scheduler copies a shared block when it is first written),
        so forking can never take blocks from another sequence sampled in this step."""
        request = parent.request
        request.forked = True
        children = []
        for index in range(1, request.params.n):
            child = self._new_sequence(request, index)
            request.seqs.append(child)
            children.append(child)
            self.scheduler.fork(parent, child)  # (the recorder forks at finish: the prompt rows come then)
        return children

    def _release(self, seq: Sequence) -> None:
        """A finished or aborted sequence gives back its blocks and, when recording, its trace."""
        self.scheduler.finish(seq)
        if self.recorder is not None:
            self.recorder.finish(seq)

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks whose every token is computed (queued) and known on the host."""
        bs = self.blocks.block_size
        for i in range(len(seq.block_hashes), min(seq.num_computed, seq.num_tokens) // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(self.blocks.register(seq.block_table[i], parent, tuple(seq.token_slice(i * bs, (i + 1) * bs))))

    def _append(self, seq: Sequence, token: int, logprob) -> None:
        grammar = seq.sampling.grammar
        if grammar is not None and not grammar.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token} it allowed")
        seq.output_ids.append(token)
        self.generation_tokens += 1
        seq.pending_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
            seq.pending_logprobs.append(logprob)
        # A stop token (EOS or a stop_token_id) ends the sequence without becoming text (as in vLLM).
        reason = self.sampler.finish_reason(seq.sampling)
        stop_string = None
        if reason == "stop":
            seq.stop_reason = self.sampler.stop_reason(seq.sampling)
        else:
            step = seq.detokenizer.add(token)
            seq.pending_text += step.text_delta
            if step.stop_string is not None:
                reason, stop_string = "stop", step.stop_string
                seq.stop_reason = stop_string
            elif reason is None and seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            if stop_string is None:
                seq.pending_text += seq.detokenizer.flush()
            seq.finish_reason = reason
            self._release(seq)
            if seq.request.finished:
                seq.request.metrics.finished_time = time.monotonic()

    def _output(self, request: Request) -> RequestOutput:
        """What is new for each choice since the last output. The whole text, ids and logprobs go
        only into the request's last output: copying them every step would cost O(length) per
        token, quadratic over a long generation."""
        final = request.finished
        outs = []
        for seq in request.seqs:
            want = seq.sampling.params.logprobs is not None
            outs.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.text if final else "",
                token_ids=list(seq.output_ids) if final else [],
                delta_text=seq.pending_text, delta_token_ids=seq.pending_ids, delta_logprobs=seq.pending_logprobs,
                logprobs=(list(seq.logprobs) if final else []) if want else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
            seq.pending_text, seq.pending_ids, seq.pending_logprobs = "", [], []
        # prompt logprobs go with the request's first output (a stream can echo the prompt at once)
        # and its last (which holds everything); the prompt is all scored before either
        prompt_logprobs = None
        if final or not request.prompt_logprobs_reported:
            prompt_logprobs, request.prompt_logprobs_reported = request.prompt_logprobs, True
        return RequestOutput(request.request_id, request.prompt_ids, outs, request.finished, request.metrics,
                             request.error, prompt_logprobs, request.num_cached_tokens)

    # --- trace recording ------------------------------------------------------------------------
    def start_recording(self, path: str | Path, model_name: str = "locus", max_bytes: int | None = None) -> None:
        """Record the routing of every request admitted from now on into a locus-trace directory (which
        stops accepting requests, and logs why, once it would grow past `max_bytes`)."""
        if self.recorder is not None:  # named, not located: the message may reach a client
            raise LocusError(f"already recording trace {self.recorder.path.name!r} ({self.recorder.state}); "
                             "dump it first")
        dtype_bytes = torch.empty((), dtype=self.model.dtype).element_size()  # replay's bytes = the served ones
        # under expert parallelism every row notes the placement epoch it ran under (and its plan)
        placement = getattr(self.lockstep, "placement_now", None)
        self.recorder = TraceRecorder(self.model.config, Path(path), model_name, dtype_bytes, placement=placement,
                                      max_bytes=max_bytes, on_failure=self._recording_failed)
        self.routing.subscribe(self.recorder.observe)
        self._prefix_caching_before = self.blocks.enable_prefix_caching
        self.blocks.enable_prefix_caching = False  # every token must go through the model

    def stop_recording(self) -> None:
        """Record no new requests; those being recorded still finish into the trace."""
        if self.recorder is None:
            raise LocusError("not recording")
        self.recorder.stop()

    def _recording_failed(self, recorder: TraceRecorder) -> None:
        # the recorder stopped itself (a full disk, say); requests go on, and it is reported until dumped
        self.recording_failures += 1

    def dump_recording(self) -> RecordingSummary:
        """Write the trace and end the recording."""
        if self.recorder is None:
            raise LocusError("not recording")
        recorder, self.recorder = self.recorder, None
        self.blocks.enable_prefix_caching = self._prefix_caching_before
        self.routing.unsubscribe(recorder.observe)
        return recorder.dump()

    # --- counters -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        running = sum(1 for r in self.requests.values() if any(s.status is SequenceStatus.RUNNING for s in r.seqs))
        return EngineStats(
            num_running=running, num_waiting=len(self.requests) - running, kv_usage=self.blocks.usage,
            num_free_blocks=self.blocks.num_free_blocks, num_blocks=self.blocks.num_blocks,
            num_preemptions=self.scheduler.num_preemptions, num_chunked_prefills=self.scheduler.num_chunked_prefills,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, prefix_cache_queries=self.blocks.stats.queried_blocks,
            prefix_cache_hits=self.blocks.stats.hit_blocks,
        )
