"""`specdecode run-batch`: a file of requests answered as the server answers them, resumably.

The files are checked before any model is loaded (batch_file.py); the requests run through the
server's own app in this process (run_batch.py). Exit status: 0 when every request has its line
(some may be errors: the summary names them), 2 for a file that cannot be used, 130 when
interrupted (run the same command again to go on), 1 when the output cannot be written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.server.cli_serve import add_served_engine_args, check_served_engine_args

MISSING_EXTRA = (
    "specdecode run-batch: error: it needs fastapi, uvicorn, prometheus_client and httpx: "
    "pip install 'specdecode[serve]'"
)


def add_run_batch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run-batch",
        help="answer a JSONL file of requests (OpenAI's Batch API format), resumably",
        description=(
            "Answer every request of --input (JSON Lines: OpenAI Batch API requests to "
            '/v1/chat/completions or /v1/completions, or plain {"prompt": ...} / '
            '{"messages": [...]} lines) into --output (the Batch API\'s output lines), through '
            "the server's continuous batching, with its answers and errors. Interrupted, the "
            "same command goes on where it stopped: no request is answered twice."
        ),
    )
    parser.add_argument("--input", type=Path, required=True, help="the requests (JSON Lines)")
    parser.add_argument(
        "--output",
        type=Path,
        required=True,
        help="the answers (JSON Lines); an existing one from the same input is continued",
    )
    add_served_engine_args(parser, timeout_default=0.0)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=handle_run_batch)
    return parser


def handle_run_batch(args: argparse.Namespace) -> int:
    check_served_engine_args(args)
    if args.input.resolve() == args.output.resolve():
        raise ValueError("--output must not be the --input file")
    if not args.output.resolve().parent.is_dir():
        raise ValueError(f"--output {args.output}: its folder does not exist")
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        print(MISSING_EXTRA, file=sys.stderr)
        return 1
    from specdecode.cli_args import engine_from_args
    from specdecode.server.batch_file import BatchFileError, ResumableOutput, read_requests
    from specdecode.server.run_batch import run_batch

    try:  # both files checked before the models load (the model name is only a default)
        requests = read_requests(args.input, args.model_name or "")
        ResumableOutput(args.output, requests)
    except BatchFileError as err:
        print(f"specdecode run-batch: error: {err}", file=sys.stderr)
        return 2
    engine = engine_from_args(args)
    try:
        summary = run_batch(
            engine,
            args.input,
            args.output,
            model_name=args.model_name or engine.target.name,
            max_batch=args.max_batch,
            max_len=args.max_len,
            prefill_chunk=args.prefill_chunk,
            prefix_cache_mb=args.prefix_cache_mb,
            timeout_s=args.timeout or None,
            max_prompt_tokens=args.max_prompt_tokens,
            max_prompt_chars=args.max_prompt_chars,
            progress=not args.quiet,
        )
    except OSError as err:
        print(
            f"specdecode run-batch: error: cannot write {args.output}: {err.strerror or err}; "
            "the lines written are kept: run the same command again once it can be written",
            file=sys.stderr,
        )
        return 1
    for line in summary.report():
        print(line, file=sys.stderr)
    return 130 if summary.interrupted else 0
