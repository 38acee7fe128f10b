"""`specdecode serve`: load the models as `specdecode generate` does, then run the HTTP server.

The main CLI calls `add_serve_parser(subparsers)`; the handler returns the exit status. fastapi,
uvicorn and prometheus_client are imported only when the command runs (the `serve` extra).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from specdecode.cli_args import (
    add_drafting_args,
    add_generation_config_arg,
    add_model_args,
    add_policy_args,
    engine_from_args,
)
from specdecode.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_PREFIX_CACHE_MB, PREFILL_CHUNK

API_KEY_ENV = "SPECDECODE_API_KEY"

MISSING_EXTRA = (
    "specdecode serve: error: the server needs fastapi, uvicorn and prometheus_client: "
    "pip install 'specdecode[serve]'"
)


def add_served_engine_args(parser: argparse.ArgumentParser, timeout_default: float) -> None:
    """The engine and its batch, as `serve` and `run-batch` take them."""
    add_model_args(parser)  # --target, --draft, --dtype, --device, --kernel
    add_drafting_args(parser)  # --k, --tree
    add_policy_args(parser)  # --k-policy, --confidence, --config
    add_generation_config_arg(parser, "OpenAI's defaults, temperature 1 and top_p 1")
    parser.add_argument(
        "--model-name", default=None, help="the model id clients send (default: the target's name)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=timeout_default,
        help="seconds per request from its arrival, queueing included; 0 = none "
        f"(default {timeout_default:g})",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=8,
        help="generations decoding together; requests join the running batch between steps "
        "(default 8; 1 = one at a time)",
    )
    parser.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="positions (prompt + new tokens) per sequence in the preallocated key/value store "
        "(default: the model's context, at most 4096)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=PREFILL_CHUNK,
        help="prefill a longer prompt in parts of this many tokens, one between two steps of "
        "the running generations, so that it does not stall their next tokens "
        f"(default {PREFILL_CHUNK}; 0 = each prompt at once)",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="host memory for the prompt prefixes finished requests leave in the key/value "
        "store, beyond its rows: a later prompt that starts the same (a system prompt, earlier "
        "turns, the same prompt) prefills only the rest, to the same bits "
        f"(default {DEFAULT_PREFIX_CACHE_MB}; 0 = only what the free rows hold)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="refuse longer prompts (default: only the model's context limits them)",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="refuse longer text prompts before tokenizing them (default: the token limit times "
        "the longest vocabulary entry, a bound no fitting prompt exceeds)",
    )


def check_served_engine_args(args: argparse.Namespace) -> None:
    """Fail on bad numbers of `add_served_engine_args` before any model is loaded."""
    if isinstance(args.k, int) and args.k < 1:  # "auto" is resolved with the models
        raise ValueError(f"k must be an integer >= 1 (got {args.k})")
    if args.max_batch < 1:
        raise ValueError(f"max-batch must be >= 1 (got {args.max_batch})")
    if args.max_len is not None and args.max_len < 2:
        raise ValueError(f"max-len must be >= 2 positions (got {args.max_len})")
    if args.prefill_chunk < 0:
        raise ValueError(f"prefill-chunk must be >= 0 tokens (got {args.prefill_chunk})")
    if not args.prefix_cache_mb >= 0:
        raise ValueError(f"prefix-cache-mb must be >= 0 (got {args.prefix_cache_mb})")
    if args.timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (got {args.timeout})")
    for name in ("max_prompt_tokens", "max_prompt_chars"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1 (got {value})")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with speculative decoding and live metrics",
        description=(
            "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
            "(Prometheus). Up to --max-batch generations decode together (continuous "
            "batching); other requests wait in a bounded queue."
        ),
    )
    add_served_engine_args(parser, timeout_default=600.0)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument(
        "--queue-size",
        type=int,
        default=16,
        help="requests that may wait while one generates; more get 429 (default 16)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"larger request bodies get 413, before they are parsed (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none; "
        "the variable keeps the key out of the process list)",
    )
    parser.add_argument(
        "--metrics-auth",
        action="store_true",
        help="require the API key on /metrics too (default: /metrics is open, like /health)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the running generation may still take before it is ended "
        "(streams get their last chunk and [DONE]); default 30",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    parser.set_defaults(func=handle_serve)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """Fail on bad numbers before any model is loaded."""
    check_served_engine_args(args)
    if args.queue_size < 0:
        raise ValueError(f"queue-size must be >= 0 (got {args.queue_size})")
    if args.max_body_bytes < 1:
        raise ValueError(f"max-body-bytes must be >= 1 (got {args.max_body_bytes})")
    if args.graceful_timeout < 0:
        raise ValueError(f"graceful-timeout must be >= 0 seconds (got {args.graceful_timeout})")
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("api-key must not be empty")
    if args.metrics_auth and args.api_key is None:
        raise ValueError(f"--metrics-auth needs an API key (--api-key or ${API_KEY_ENV})")
    if not 0 <= args.port < 65536:
        raise ValueError(f"port must be in [0, 65535] (got {args.port})")


def handle_serve(args: argparse.Namespace) -> int:
    _check_args(args)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(MISSING_EXTRA, file=sys.stderr)
        return 1
    from specdecode.server.app import create_app
    from specdecode.server.run import serve

    engine = engine_from_args(args)
    app = create_app(
        engine,
        args.model_name or engine.target.name,
        queue_size=args.queue_size,
        max_batch=args.max_batch,
        max_len=args.max_len,
        prefill_chunk=args.prefill_chunk,
        prefix_cache_mb=args.prefix_cache_mb,
        timeout_s=args.timeout or None,
        max_prompt_tokens=args.max_prompt_tokens,
        max_prompt_chars=args.max_prompt_chars,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key,
        metrics_auth=args.metrics_auth,
    )
    session = app.state.server.worker.session
    print(
        f"specdecode: a batch of up to {session.max_rows} sequences of {session.max_len} "
        f"positions; key/value store preallocated: {session.store_bytes / 2**20:.1f} MiB",
        file=sys.stderr,
    )
    serve(
        app,
        args.host,
        args.port,
        graceful_timeout_s=args.graceful_timeout,
        log_level=args.log_level,
    )
    # the process exits next: spare the interpreter's exit the garbage collector's passes over
    # every object (the models, torch's and transformers' thousands of modules), about a second
    # of an idle server's exit on SIGTERM; the objects are still freed, by reference counts
    gc.freeze()
    return 0
