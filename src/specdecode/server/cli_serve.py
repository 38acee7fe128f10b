"""`specdecode serve`: load the models as `specdecode generate` does, then run the HTTP server.

The main CLI calls `add_serve_parser(subparsers)`; the handler returns the exit status. fastapi and
uvicorn are imported only when the command runs (they come with the `serve` extra).
"""

from __future__ import annotations

import argparse
import sys

from specdecode.cli_args import add_drafting_args, add_model_args, add_policy_args, engine_from_args

MISSING_EXTRA = (
    "specdecode serve: error: the server needs fastapi and uvicorn: pip install 'specdecode[serve]'"
)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with speculative decoding and live metrics",
        description=(
            "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics "
            "(Prometheus). One generation runs at a time; other requests wait in a bounded queue."
        ),
    )
    add_model_args(parser)  # --target, --draft, --dtype, --device, --kernel
    add_drafting_args(parser)  # --k, --tree
    add_policy_args(parser)  # --k-policy, --confidence, --config
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="default 8000")
    parser.add_argument(
        "--model-name", default=None, help="the model id clients send (default: the target's name)"
    )
    parser.add_argument(
        "--queue-size",
        type=int,
        default=16,
        help="requests that may wait while one generates; more get 429 (default 16)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds per request from its arrival, queueing included; 0 = none (default 600)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="refuse longer prompts (default: only the model's context limits them)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    parser.set_defaults(func=handle_serve)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """Fail on bad numbers before any model is loaded."""
    if args.k is not None and args.k < 1:
        raise ValueError(f"k must be an integer >= 1 (got {args.k})")
    if args.queue_size < 0:
        raise ValueError(f"queue-size must be >= 0 (got {args.queue_size})")
    if args.timeout < 0:
        raise ValueError(f"timeout must be >= 0 seconds (got {args.timeout})")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"max-prompt-tokens must be >= 1 (got {args.max_prompt_tokens})")
    if not 0 <= args.port < 65536:
        raise ValueError(f"port must be in [0, 65535] (got {args.port})")


def handle_serve(args: argparse.Namespace) -> int:
    _check_args(args)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        print(MISSING_EXTRA, file=sys.stderr)
        return 1
    from specdecode.server.app import create_app

    engine = engine_from_args(args)
    app = create_app(
        engine,
        args.model_name or engine.target.name,
        queue_size=args.queue_size,
        timeout_s=args.timeout or None,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
