"""`locus serve`: the OpenAI-compatible HTTP server on uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from locus.engine.cli import SHIPPED_DEFAULT_HELP, add_model_args
from locus.errors import LocusError
from locus.flags import NumericFlag, check_flags, check_range
from locus.routing.cli import PAYLOAD_FORMATS as EP_PAYLOAD_FORMATS  # the replay's copy: no torch at parse time


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                              description="Serve a model over an OpenAI-compatible HTTP API. Without --model, the "
                                          "shipped trained 'mini' checkpoint is served (locus/assets/mini; where it is "
                                          "missing, the 'tiny' preset with RANDOM weights). No download.")
    add_model_args(p, SHIPPED_DEFAULT_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address or name to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port, 1-65535; 0 takes any free port, which the 'running on' line names (default 8000)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: the model dir's name)")
    p.add_argument("--seed", type=int, default=0, help="weight seed for presets")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one decode batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one prefill step")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="memory for the paged KV cache, e.g. 512MiB, 4GiB")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-waiting", type=int, default=None, help="reject new requests with 503 beyond this many waiting")
    p.add_argument("--burst-wait-ms", type=float, default=2.0,
                   help="an idle engine that gets a request waits until none has arrived for this long (at most "
                        "20x as long) before its first step, so a burst is prefilled in one step; a lone request's "
                        "TTFT grows by at most this (0: start at once; not used under expert parallelism)")
    p.add_argument("--record-trace", default=None, metavar="DIR",
                   help="record every request's expert routing into a locus-trace directory (written at shutdown; "
                        "prefix caching is bypassed while recording)")
    p.add_argument("--max-grammar-bytes", type=int, default=64 * 1024, metavar="N",
                   help="largest output constraint (JSON schema, regex, grammar, choices) accepted, in bytes (default 65536)")
    p.add_argument("--max-grammar-compile-seconds", type=float, default=10.0, metavar="S",
                   help="a request whose output constraint takes longer to compile is refused (default 10)")
    p.add_argument("--grammar-cache-bytes", default="256MiB", metavar="SIZE",
                   help="memory of compiled output constraints kept for reuse (default 256MiB)")
    p.add_argument("--enable-trace-api", action="store_true",
                   help="serve /traces/start|stop|dump (admin): record routing on demand into --trace-dir")
    p.add_argument("--trace-dir", default="traces", metavar="DIR",
                   help="the only directory /traces/start writes into; a client names a trace inside it (default ./traces)")
    p.add_argument("--trace-max-bytes", default="1GiB", metavar="SIZE",
                   help="the most --trace-dir may hold: a recording started over HTTP stops taking requests before "
                        "the directory would pass it, and /traces/start is refused (507) once it is full (default 1GiB)")
    p.add_argument("--max-request-body-bytes", default="32MiB", metavar="SIZE",
                   help="a request body larger than this is refused with a 400 before it is read (default 32MiB)")
    p.add_argument("--max-prompts-per-request", type=int, default=1024, metavar="N",
                   help="most prompts one /v1/completions request may batch (default 1024)")
    p.add_argument("--max-stop-chars", type=int, default=4096, metavar="N",
                   help="most characters a request's stop strings may hold, all of them together (default 4096)")
    p.add_argument("--max-logit-bias", type=int, default=1024, metavar="N",
                   help="most entries one request's logit_bias may hold (default 1024)")
    p.add_argument("--max-logprob-entries", type=int, default=1 << 20, metavar="N",
                   help="most logprob entries one /v1/completions response may hold: prompts x n x (echoed prompt "
                        "tokens + max_tokens) x (logprobs + 1), vLLM's prompt_logprobs counted the same way "
                        "(default 1048576, about 32 MB of JSON)")
    p.add_argument("--plan", default=None, metavar="PLAN.json",
                   help="placement plan (locus plan --planner locality): its grouper puts requests with similar "
                        "expert usage in the same micro-batch, one micro-batch per node")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template (a file, or the template text) for checkpoints without one, or to replace theirs")
    p.add_argument("--ep-ranks", type=int, default=1, metavar="N",
                   help="expert parallelism over N local processes (ranks); the experts are placed by --plan, "
                        "else round-robin. Under torchrun the launcher's WORLD_SIZE decides instead")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="ranks per (virtual) node for --ep-ranks (default: all on one node)")
    p.add_argument("--ep-timeout", type=float, default=60.0, help="seconds any expert-parallel collective may take")
    p.add_argument("--ep-exchange", choices=("exact", "fixed"), default="exact",
                   help="how a MoE layer's rows travel: 'exact' sends a small count all-to-all, then exactly the rows; "
                        "'fixed' sends blocks sized by the step's largest token count (no count exchange, padding on "
                        "the wire; DeepEP's low-latency layout). See docs/expert_parallel.md for which is faster where")
    p.add_argument("--ep-dispatch-format", choices=EP_PAYLOAD_FORMATS, default="model",
                   help="how a MoE layer's dispatched rows travel: 'model' in the model's dtype, 'mxfp8' / 'mxint8' "
                        "quantized (one byte a value and an E8M0 scale per 32 values, dequantized on arrival; every "
                        "expert, local ones included, computes on the dequantized rows). See docs/formats.md")
    p.add_argument("--ep-combine-format", choices=EP_PAYLOAD_FORMATS, default="model",
                   help="how the experts' partial sums travel back (default: the model's dtype, as DeepEP combines)")
    p.add_argument("--ep-max-tokens-per-rank", type=int, default=256, metavar="N",
                   help="the fixed exchange's bound: a step where a rank may run more tokens uses the exact exchange")
    p.add_argument("--ep-loop-nice", type=int, default=19, metavar="N",
                   help="the nice value (0-19) of gloo's event-loop threads in every rank: they spin while a rank's "
                        "own thread holds a connection, and where ranks share cores the spin slows that thread "
                        "(docs/expert_parallel.md); 0 leaves them at the rank's priority (default: 19)")
    p.add_argument("--ep-elastic", action="store_true",
                   help="survive a lost rank: the survivors regroup, re-plan onto themselves and resume its requests "
                        "from what they streamed (docs/expert_parallel.md); without it a lost rank ends the server")
    p.add_argument("--ep-max-slots", type=int, default=None, metavar="S",
                   help="with --ep-elastic: the expert slots a survivor may grow to when the others cannot hold every "
                        "expert (default: all of them)")
    p.add_argument("--ep-moves", action="store_true",
                   help="move a request to another rank right after its prefill when the plan's grouper says the decode "
                        "bytes it saves pay for sending its KV cache (the plan's grouping.move_margin); the KV bytes "
                        "count as migration bytes in /ep/stats (docs/planner.md). Needs a --plan with a grouping")
    p.add_argument("--replan-every", default=None, metavar="SECONDS|Nsteps",
                   help="re-plan the expert placement live from the last --replan-window tokens of routing, every "
                        "SECONDS (e.g. 600) or N steps (e.g. 3000steps), with the plan's own planner; the new plan "
                        "moves in only if the replay of the window predicts it saves more inter-node bytes than the "
                        "move sends (docs/expert_parallel.md)")
    p.add_argument("--replan-api", action="store_true",
                   help="serve POST /ep/replan (admin): re-plan now, {\"force\": true} moves even when it does not pay")
    p.add_argument("--replan-window", type=int, default=4096, metavar="TOKENS",
                   help="tokens of routing each rank keeps for a re-plan (default 4096)")
    p.add_argument("--replan-layers-per-step", type=int, default=1, metavar="K",
                   help="MoE layers a placement move switches per iteration (default 1)")
    p.add_argument("--ep-overlap", action="store_true",
                   help="split each step into two micro-batches on two sets of process groups, so one's attention and "
                        "experts run while the other's dispatch or combine is on the wire (two-batch overlap)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the decode forward, one graph per batch-size bucket, at start-up (inductor's "
                        "on-disk cache makes the next start fast; on CUDA the compiled forward is what gets captured); "
                        "prefill stays eager. See docs/engine.md")
    p.add_argument("--compile-buckets", default=None, metavar="B1,B2,...", type=bucket_list,
                   help="decode batch sizes with a graph of their own, compiled and/or captured (default: 1, 2, 4, ... "
                        "up to --max-num-seqs); a batch pads to the smallest bucket that holds it, larger batches run "
                        "eagerly")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on CUDA, do not capture decode steps as CUDA graphs (captured by default there; CPU never "
                        "captures)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap the host's work with the device's: schedule and prepare step N + 1 while step N runs, "
                        "then detokenize and stream step N (default: off; it has not yet measured faster, on CPU or on "
                        "an H200). See docs/engine.md")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds requests in flight get to finish after SIGTERM (SIGINT ends them at once with an "
                        "error; a second SIGINT exits on the spot)")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run_serve)


# Every numeric flag of `locus serve` and its range, checked before torch is imported (a zero or negative
# count, size or time, or a NaN, made a server that started and then refused or mis-served everything).
# --max-model-len's upper bound is the model's and is checked once its config is read (check_model_len).
SERVE_FLAGS = (
    NumericFlag("--port", 0, 65535, unit="(0: any free port)"),
    NumericFlag("--seed", -(1 << 63), (1 << 64) - 1),  # what torch.manual_seed takes
    NumericFlag("--max-num-seqs"),
    NumericFlag("--max-num-batched-tokens"),
    NumericFlag("--max-model-len"),
    NumericFlag("--kv-cache-memory", memory=True),
    NumericFlag("--num-kv-blocks"),
    NumericFlag("--block-size"),
    NumericFlag("--max-waiting"),  # 0 would refuse every request
    NumericFlag("--burst-wait-ms", 0, 1000),
    NumericFlag("--max-grammar-bytes"),
    NumericFlag("--max-grammar-compile-seconds", positive=True, unit="seconds"),
    NumericFlag("--grammar-cache-bytes", 0, memory=True),  # 0 keeps no compiled constraint
    NumericFlag("--trace-max-bytes", memory=True),
    NumericFlag("--max-request-body-bytes", memory=True),
    NumericFlag("--max-prompts-per-request"),
    NumericFlag("--max-stop-chars"),
    NumericFlag("--max-logit-bias", 0),
    NumericFlag("--max-logprob-entries", 0),
    NumericFlag("--ep-ranks"),
    NumericFlag("--gpus-per-node"),
    NumericFlag("--ep-timeout", positive=True, unit="seconds"),
    NumericFlag("--ep-max-tokens-per-rank"),
    NumericFlag("--ep-loop-nice", 0, 19),
    NumericFlag("--ep-max-slots"),
    NumericFlag("--replan-window"),
    NumericFlag("--replan-layers-per-step"),
    NumericFlag("--graceful-timeout", 0, unit="seconds"),
)


def check_model_len(args: argparse.Namespace) -> None:
    """--max-model-len at most the model's own context (a longer one has no positions to run on)."""
    if args.max_model_len is None:
        return
    from locus.engine.checkpoint.loader import config_of

    try:
        limit = config_of(args.model).max_position_embeddings
    except LocusError:  # a model that cannot load is reported as such by the load (exit 1), not as a flag
        return
    check_range("--max-model-len", args.max_model_len, 1, limit, unit=f"(the context of model {args.model!r})")


def check_local_memory(args: argparse.Namespace, ranks: int) -> None:
    """The processes this command starts on this machine must fit its free memory (on CPU, where the
    KV pools and weights are host memory); under torchrun each machine's launcher starts its own."""
    if "WORLD_SIZE" in os.environ:
        return
    from locus.engine.checkpoint.loader import default_device
    from locus.server.fit import check_fits, launch_memory, mem_available

    if not (args.device or default_device()).startswith("cpu"):
        return
    from locus.flags import parse_memory

    try:
        need = launch_memory(args.model, args.dtype, parse_memory(args.kv_cache_memory), args.num_kv_blocks,
                             args.block_size, ranks)
    except LocusError:  # a model that cannot load is reported as such by the load (exit 1), not as a flag
        return
    check_fits(need, mem_available())


def bucket_list(text: str) -> tuple[int, ...]:
    from locus.engine.runner.decode_graph import parse_buckets

    try:
        return tuple(parse_buckets(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config_of(args: argparse.Namespace):
    from locus.engine.core.engine_core import EngineConfig, parse_memory

    return EngineConfig(
        block_size=args.block_size, kv_cache_memory=parse_memory(args.kv_cache_memory), num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        compile_decode=args.compile,
        compile_buckets=args.compile_buckets, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        grammar_limits=grammar_limits_of(args))


def request_limits_of(args: argparse.Namespace):
    from locus.engine.core.engine_core import parse_memory
    from locus.server.protocol import RequestLimits

    return RequestLimits(max_body_bytes=parse_memory(args.max_request_body_bytes), max_prompts=args.max_prompts_per_request,
                         max_stop_chars=args.max_stop_chars, max_logit_bias=args.max_logit_bias,
                         max_logprob_entries=args.max_logprob_entries)


def grammar_limits_of(args: argparse.Namespace):
    from locus.engine.core.engine_core import parse_memory
    from locus.engine.sampling.grammar_limits import GrammarLimits

    return GrammarLimits(max_bytes=args.max_grammar_bytes, compile_seconds=args.max_grammar_compile_seconds,
                         cache_bytes=parse_memory(args.grammar_cache_bytes))


def run_rank(args: argparse.Namespace, setup) -> int:
    """A rank other than 0: the same model and engine, no HTTP; iterate with rank 0 until it stops."""
    from locus.engine.ep.ranks.launch import PARENT_ENV, follow_parent
    from locus.engine.ep.ranks.worker import build_worker, report_failure
    from locus.server.state import served_name

    log = logging.getLogger("locus.engine")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then tells this rank to stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if PARENT_ENV in os.environ:  # started by `--ep-ranks`, not by torchrun (whose agent stops its workers)
        follow_parent(setup.rank)
    code = 0
    try:
        worker, _ = build_worker(setup, args.model, engine_config_of(args), dtype=args.dtype, device=args.device,
                                 moe_backend=args.moe_backend, seed=args.seed, record_trace=args.record_trace,
                                 model_name=served_name(args.model, args.served_model_name),
                                 quantize_experts=args.quantize_experts)
        worker.serve()
    except BaseException as exc:  # noqa: BLE001 - a dead peer or a timed-out collective ends this rank too
        log.exception("rank %d stops", setup.rank)
        report_failure(setup.rank, exc)
        code = 1
    # No destroy_process_group: it may wait on peers. Leaving closes this rank's connections, so every
    # peer's next collective with it fails at once instead of at the timeout.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_children(children, wait_s: float = 10.0) -> None:
    """No rank outlives rank 0: wait a moment for the stop message to land, then kill."""
    for child in children:
        try:
            child.wait(wait_s)
        except Exception:  # noqa: BLE001 - still running after rank 0 is done: end it
            child.kill()
            child.wait()


def start_failure(load_error: str | None, lost: str | None) -> str:
    """The one line `locus serve` ends with when it never served: rank 0's load error, the ranks that
    exited while starting, and (best effort) what the first failed rank said."""
    from locus.engine.ep.ranks.worker import failure_cause

    if lost is None:
        return f"the model failed to load: {load_error}"
    cause = failure_cause() or "it left no message (killed?)"
    line = f"the expert-parallel launch failed: {lost} exited while starting: {cause}"
    return f"{line}; rank 0: {load_error}" if load_error else line


def run_serve(args: argparse.Namespace) -> int:
    check_flags(args, SERVE_FLAGS)  # before torch: --port 99999 was taken modulo 65536, --max-model-len -5 served
    import uvicorn

    from locus.engine.checkpoint.loader import default_serve_model
    from locus.engine.core.engine_core import parse_memory
    from locus.engine.ep.ranks.launch import SPAWNED, exited_ranks, setup_from, spawn_local_ranks, watch_start
    from locus.server.app import create_app
    from locus.server.lifecycle import ListenError, LocusServer, bind_listeners
    from locus.server.state import ServerConfig

    if args.model is None:  # the shipped trained model when it is installed, else the random `tiny` preset
        args.model = default_serve_model()
    if SPAWNED not in os.environ:  # rank 0 checked these for the ranks it starts
        check_model_len(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan = None
    if args.plan is not None:  # a bad file fails here in one line, before the model loads (its fit to the model: later)
        from locus.routing.plan.placement import load_plan

        plan = load_plan(args.plan)
    setup = setup_from(args.ep_ranks, args.gpus_per_node, args.ep_timeout, args.plan, args.ep_exchange,
                       args.ep_max_tokens_per_rank, args.ep_overlap, args.replan_every, args.replan_api,
                       args.replan_window, args.replan_layers_per_step, args.ep_elastic, args.ep_max_slots,
                       args.ep_loop_nice, args.ep_dispatch_format, args.ep_combine_format)
    if setup is not None:
        setup.moves = args.ep_moves
        setup.plan = plan  # this rank's load_rank takes it as loaded, checking only its fit to the model
    elif args.ep_moves:
        raise LocusError("--ep-moves moves requests between expert-parallel ranks: add --ep-ranks N and a --plan")
    if setup is None and (args.ep_dispatch_format != "model" or args.ep_combine_format != "model"):
        raise LocusError("--ep-dispatch-format / --ep-combine-format set how expert-parallel exchanges send rows: "
                         "add --ep-ranks N (or run under torchrun)")
    if setup is None and (args.replan_every or args.replan_api):
        raise LocusError("--replan-every / --replan-api re-plan an expert-parallel placement: add --ep-ranks N")
    if setup is not None and setup.rank != 0:
        return run_rank(args, setup)
    engine = engine_config_of(args)  # every flag is checked before a rank starts: a launch is whole or nothing
    limits, trace_max_bytes = request_limits_of(args), parse_memory(args.trace_max_bytes)
    if SPAWNED not in os.environ:
        check_local_memory(args, setup.world if setup is not None else 1)
    try:  # before any thread or rank starts, so that failing here is one line and a plain exit
        sockets = bind_listeners(args.host, args.port)
    except ListenError as exc:
        print(f"locus: error: {exc}", file=sys.stderr)
        return 1
    children = spawn_local_ranks(setup) if setup is not None and SPAWNED not in os.environ and "WORLD_SIZE" not in os.environ else []
    app = create_app(ServerConfig(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
        moe_backend=args.moe_backend, seed=args.seed, engine=engine, max_waiting=args.max_waiting,
        burst_wait_ms=args.burst_wait_ms,
        record_trace=args.record_trace, plan=args.plan, plan_loaded=plan, ep=setup, chat_template=args.chat_template,
        trace_api=args.enable_trace_api, trace_dir=args.trace_dir, trace_max_bytes=trace_max_bytes,
        limits=limits,
        quantize_experts=args.quantize_experts))

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_graceful_shutdown=args.graceful_timeout)
    state = app.state.locus
    server = LocusServer(config, state, args.graceful_timeout, children)

    def stop_on_load_failure() -> None:  # a model that cannot load is fatal, as in vLLM
        server.should_exit = True

    engine_died = threading.Event()

    def stop_on_engine_death() -> None:  # never a live process with a dead engine
        engine_died.set()
        server.should_exit = True

    state.on_load_failed = stop_on_load_failure
    state.on_engine_dead = stop_on_engine_death
    watch_start(children, lambda: state.engine is not None or server.should_exit, stop_on_load_failure)
    code = 0
    try:
        server.run(sockets=sockets)
    except SystemExit:  # uvicorn gave up at start-up (it logged why); exit below, as every other way out does
        code = 1
    # uvicorn put back Python's handler: a KeyboardInterrupt now would unwind past the ranks and threads
    signal.signal(signal.SIGINT, lambda sig, frame: server.exit_now())
    lost = exited_ranks(children) if state.engine is None else None  # before stop_children ends the rest
    if lost or state.load_error:
        print(f"locus: error: {start_failure(state.load_error, lost)}", file=sys.stderr)
        code = 1
    if engine_died.is_set():
        print("locus: error: the engine failed (traceback above); exiting", file=sys.stderr)
        code = 1
    stop_children(children, 10.0 if state.engine is not None else 0.0)  # no engine: no stop message to wait for
    # Everything is drained and written by now. Skip interpreter finalisation: with torch 2.13 it
    # tears down Triton's bindings (imported by torch itself) and prints pages of nanobind "leak" noise.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
