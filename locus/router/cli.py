"""`locus route`: the plan's grouper in front of data-parallel engines (docs/router.md)."""

from __future__ import annotations

import argparse
import signal
import sys

from locus.errors import LocusError
from locus.flags import check_range
from locus.listen import ListenError, address, bind_listeners, bound_port


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "route", help="a locality-aware OpenAI router: send each request to the data-parallel rank the plan's "
                      "grouper chooses",
        description="Serve the OpenAI completion endpoints in front of one engine endpoint per data-parallel "
                    "rank (or one per group of ranks, pinned with X-Data-Parallel-Rank), sending each request to "
                    "the rank the plan's grouper chooses: its domain tag, else the plan's prompt predictor on its "
                    "tokenized prompt, under the plan's caps. docs/router.md.")
    p.add_argument("--plan", required=True, help="placement plan JSON with a grouping (`locus plan --planner locality`)")
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="an engine's base URL, once per data-parallel rank in rank order (rank r on node r // G)")
    p.add_argument("--backend-kind", choices=("locus", "vllm", "sglang"), default="locus",
                   help="what the backends run: how the request id and a rank pin are passed (default locus)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the model's directory (tokenizer.json, tokenizer_config.json; config.json to check the "
                        "plan's predictor against); default: the plan's model when it is `mini` or a directory")
    p.add_argument("--chat-template", metavar="FILE", help="the chat template the backends use, if not the tokenizer's")
    p.add_argument("--assignment-log", metavar="FILE",
                   help="write every admission and release as JSON lines (`locus replay --assign FILE`, "
                        "`locus trace merge --route-log FILE`)")
    p.add_argument("--max-model-len", type=int, help="the context limit a request without max_tokens is charged "
                                                    "up to (default: the backends' /v1/models max_model_len)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often every backend's /health is asked (default 1)")
    p.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long a backend may take to answer at start (default 5)")
    p.add_argument("--graceful-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, how long open streams may go on before they end with an error frame (default 10)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 takes any free port, which the 'running on' line names")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run_route)


def run_route(args: argparse.Namespace) -> int:
    import uvicorn

    from locus.router.setup import RouterConfig, assemble

    check_range("--port", args.port, 0, 65535, unit="(0: any free port)")
    try:
        sockets = bind_listeners(args.host, args.port, backlog=2048)
    except ListenError as exc:
        raise LocusError(str(exc)) from None
    router = assemble(RouterConfig(args.plan, args.backend, args.backend_kind, args.tokenizer,
                                   read_template(args.chat_template), args.assignment_log, args.max_model_len,
                                   args.health_interval, args.connect_timeout))
    print(f"locus route: running on http://{address(args.host, bound_port(sockets))} "
          f"in front of {len(router.relay.pool.backends)} backend(s)",
          file=sys.stderr, flush=True)
    from locus.router.wire import RouterHttpProtocol

    # no proxy-headers middleware: the router reads no client address
    config = uvicorn.Config(router.app(), log_level=args.log_level, access_log=False, loop="uvloop",
                            http=RouterHttpProtocol, ws="none", lifespan="on", timeout_keep_alive=30,
                            proxy_headers=False, timeout_graceful_shutdown=args.graceful_timeout)
    # uvicorn drains on SIGTERM / SIGINT, then raises the signal again for the handler it found:
    # that one is ours and does nothing, so a drained router exits 0, as `locus serve` does
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        uvicorn.Server(config).run(sockets=sockets)
    finally:
        router.close()
    return 0


def read_template(value: str | None) -> str | None:
    if value is None:
        return None
    from locus.chat_template import read_chat_template

    return read_chat_template(value)


