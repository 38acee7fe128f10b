"""`specdecode bench-serve`: argparse -> LoadConfig -> bench/serve_load.py, or `--compare DIR...`
-> bench/serve_compare.py."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from pathlib import Path

from specdecode.cli_args import csv_list, int_csv

API_KEY_ENV = "SPECDECODE_API_KEY"  # the variable `specdecode serve` reads too


def add_bench_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`bench-serve` on the main command's subparsers."""
    from specdecode.bench.serve_load import DEFAULT_CONCURRENCY

    default_levels = ",".join(map(str, DEFAULT_CONCURRENCY))
    parser = subparsers.add_parser(
        "bench-serve",
        help="load-test any OpenAI-compatible endpoint: throughput and latency vs concurrency",
        description="For each concurrency level, that many clients send streamed requests back "
        "to back (closed loop) to /v1/completions (or /v1/chat/completions with --chat); each "
        "request's time to first token, gaps between chunks, latency and tokens are recorded. "
        "Writes results.jsonl, summary.json, report.md and plots. With --compare, puts saved "
        "runs side by side instead.",
    )
    parser.add_argument(
        "--endpoint", default=None, metavar="URL", help="base URL, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="DIR",
        help="compare saved runs (folders written by bench-serve) instead of measuring",
    )
    parser.add_argument(
        "--concurrency",
        type=int_csv,
        default=list(DEFAULT_CONCURRENCY),
        help=f"comma-separated numbers of concurrent clients (default {default_levels})",
    )
    parser.add_argument("--prompts", default=None, help="JSONL file (ours or Spec-Bench format)")
    parser.add_argument(
        "--categories", type=csv_list, default=None, help="comma-separated prompt categories"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="max_tokens (default 64)")
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument(
        "--requests-per-level",
        type=int,
        default=None,
        metavar="N",
        help="requests sent at each level (default max(16, 4 x concurrency))",
    )
    amount.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="instead: send requests for S seconds per level (those under way then finish)",
    )
    parser.add_argument(
        "--model", default=None, help="the model to request (default: the one /v1/models lists)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="/v1/chat/completions, the prompt as one user message (default: /v1/completions)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    parser.add_argument("--seed", type=int, default=None, help="sent with every request")
    parser.add_argument(
        "--label", default=None, help="the run's name in reports (default: --out's)"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"sent as a bearer token (default ${API_KEY_ENV}); never written to the results",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for the server (default 600)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unrecorded requests before the first level (default 1)",
    )
    parser.add_argument(
        "--prompt-order",
        default="restart",
        metavar="restart|continue",
        help="restart: every level from the first prompt (a server's prompt cache sees the "
        "same prompts again); continue: each level after the last one's prompts, so that a "
        "prompt comes back only after all were sent (default restart)",
    )
    parser.add_argument(
        "--no-usage",
        dest="stream_usage",
        action="store_false",
        help="do not send stream_options.include_usage (tokens are then counted as chunks)",
    )
    parser.add_argument("--out", default=None, help="output folder (default runs/bench-serve-TIME)")
    parser.set_defaults(func=handle_bench_serve)
    return parser


def handle_bench_serve(args: argparse.Namespace) -> int:
    if (args.endpoint is None) == (args.compare is None):
        raise ValueError(
            "bench-serve: give --endpoint URL to measure a server, or --compare DIR DIR... to "
            "put saved runs side by side"
        )
    if args.compare is not None:
        from specdecode.bench.serve_compare import COMPARE_MD, compare_runs

        out = args.out or time.strftime("runs/bench-serve-compare-%Y%m%d-%H%M%S")
        compare_runs(args.compare, out)
        print((Path(out) / COMPARE_MD).read_text())
        return 0

    from specdecode.bench.serve_load import LoadConfig, run_load
    from specdecode.bench.serve_report import main_table

    config = LoadConfig(
        endpoint=args.endpoint,
        out=args.out or time.strftime("runs/bench-serve-%Y%m%d-%H%M%S"),
        concurrency=args.concurrency,
        prompts_file=args.prompts,
        categories=args.categories,
        max_new_tokens=args.max_new_tokens,
        requests_per_level=args.requests_per_level,
        duration_s=args.duration,
        model=args.model,
        chat=args.chat,
        temperature=args.temperature,
        seed=args.seed,
        label=args.label,
        api_key=args.api_key or os.environ.get(API_KEY_ENV),
        timeout_s=args.timeout,
        warmup=args.warmup,
        stream_usage=args.stream_usage,
        command=_command(getattr(args, "argv", [])),
        prompt_order=args.prompt_order,
    )
    summary = run_load(config)
    print(main_table(summary))
    print(f"\nreport: {config.out}/report.md (summary.json, results.jsonl, plots beside it)")
    return 0


def _command(argv: list[str]) -> str:
    """The command line as recorded, an --api-key's value hidden."""
    shown = list(argv)
    for i, arg in enumerate(shown):
        name, equals, _ = arg.partition("=")
        if len(name) >= len("--api") and "--api-key".startswith(name):  # argparse abbreviates
            if equals:
                shown[i] = f"{name}=***"
            elif i + 1 < len(shown):
                shown[i + 1] = "***"
    return shlex.join(["specdecode", *shown])
