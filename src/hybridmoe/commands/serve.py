"""`hybridmoe serve --model DIR`: an OpenAI- and Ollama-compatible HTTP server with a web chat page.

Binds to 127.0.0.1 unless --host says otherwise. Every engine option is a flag too. Prints the
engine's choices (doctor's line) to stderr before it starts listening. A client has --timeout-headers
seconds to send a request's headers and --timeout-body more for its body (408 past them), and an idle
connection closes after --timeout-keep-alive seconds.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from hybridmoe.commands.engine_args import add_engine_arguments, add_model_argument, engine_kwargs
from hybridmoe.errors import HybridMoEError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = add_model_argument(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, metavar="PORT",
                        help="port to listen on, 0-65535 (default: 8000)")
    server.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1 and /api routes (default: no key)")
    server.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients use (default: the model directory's name)")
    server.add_argument("--max-batch", type=int, default=None, metavar="N",
                        help="most requests decoded together; the same as --max-num-seqs (default: 8)")
    server.add_argument("--max-queue", type=int, default=64, metavar="N",
                        help="most requests waiting for a slot; past them 429 with Retry-After (default: 64)")
    server.add_argument("--timeout-headers", type=float, default=30.0, metavar="S",
                        help="seconds a client has to send a request's headers; past them 408 (default: 30)")
    server.add_argument("--timeout-body", type=float, default=60.0, metavar="S",
                        help="seconds a client has to send a request's body, after its headers (default: 60)")
    server.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                        help="seconds an idle connection stays open between requests (default: 5)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        metavar="critical|error|warning|info|debug", help="uvicorn's log level (default: info)")
    add_engine_arguments(parser, model)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from hybridmoe.commands.doctor import print_choices
    from hybridmoe.config import EngineConfig
    from hybridmoe.engine.llm_engine import LLMEngine
    from hybridmoe.server.app import build_app
    from hybridmoe.server.async_engine import AsyncEngine
    from hybridmoe.server.http_protocol import deadline_protocol
    from hybridmoe.weights.gguf_model_dir import resolve_model_path

    kwargs = engine_kwargs(args)
    if args.max_batch is not None:
        if kwargs.get("max_num_seqs", args.max_batch) != args.max_batch:
            raise HybridMoEError(f"--max-batch {args.max_batch} and --max-num-seqs {kwargs['max_num_seqs']} "
                                 f"disagree; give one of them")
        kwargs["max_num_seqs"] = args.max_batch
    if args.max_queue < 0:
        raise HybridMoEError(f"--max-queue must be at least 0, got {args.max_queue}")
    for flag in ("timeout_headers", "timeout_body", "timeout_keep_alive"):
        if not 0 < getattr(args, flag) < float("inf"):
            raise HybridMoEError(f"--{flag.replace('_', '-')} must be a number of seconds above 0, "
                                 f"got {getattr(args, flag)}")
    if not 0 <= args.port < 65536:
        raise HybridMoEError(f"--port must be in [0, 65535], got {args.port}")
    config = EngineConfig.from_kwargs(**kwargs)
    api_key = args.api_key or None
    name = args.served_model_name or _served_name(args.model)
    _check_port(args.host, args.port)  # before the load, which can take minutes

    llm_engine = LLMEngine(resolve_model_path(args.model, config), config)
    print_choices(llm_engine)
    engine = AsyncEngine(llm_engine, max_queue=args.max_queue)
    app = build_app(engine, name, api_key=api_key)
    print(f"serving {name} on http://{args.host}:{args.port} (max batch {engine.max_running}, "
          f"max queue {args.max_queue}, context {engine.max_model_len} tokens"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                http=deadline_protocol(args.timeout_headers, args.timeout_body),
                timeout_keep_alive=args.timeout_keep_alive)
    return 0


def _served_name(model: str) -> str:
    """The name clients ask for: a local directory's or .gguf file's own name, else the repo id as given (vLLM
    serves a Hub model under its id)."""
    path = Path(model)
    if path.exists():
        return path.resolve().stem if path.is_file() else path.resolve().name
    return model


def _check_port(host: str, port: int) -> None:
    """Bind host:port as uvicorn will (IPv6 when the host has a colon, SO_REUSEADDR) and let it go again."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise HybridMoEError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                                 f"stop what holds port {port}, or pass another --port or --host") from None
