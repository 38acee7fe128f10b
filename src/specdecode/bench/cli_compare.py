"""`specdecode compare`: argparse -> CompareConfig -> bench/compare.py."""

from __future__ import annotations

import argparse
import shlex
import time

from specdecode.cli_args import TREE_HELP, add_kernel_arg, csv_list, int_csv

DEFAULT_VARIANTS = "int8,int4,drop-layers=4,prune-mlp=0.25"


def add_compare_parser(subparsers: argparse._SubParsersAction) -> None:
    """`compare` on the main command's subparsers."""
    from specdecode.bench.variants import VARIANT_FORMS

    parser = subparsers.add_parser(
        "compare",
        help="speculation, quantization and pruning side by side, on speed and on quality",
        description="Make each variant of the target (quantized, pruned), run every variant "
        "alone and with speculation on the same prompts in one process, interleaved per "
        "prompt, score each against the target's own greedy answers (KL divergence, top-1 "
        "agreement, perplexity) and on a task set, and write compare.json, report.md and a "
        "quality-vs-speed plot.",
    )
    parser.add_argument("--target", required=True, help="preset name, folder, .gguf or hub id")
    parser.add_argument(
        "--draft",
        required=True,
        help="the draft of the speculative rows: a model (MODEL:int8 / MODEL:int4), "
        "ngram[:MIN-MAX] or early-exit:N (each variant's own first layers)",
    )
    parser.add_argument(
        "--variants",
        type=csv_list,
        default=csv_list(DEFAULT_VARIANTS),
        help=f"comma-separated, from {VARIANT_FORMS} (default {DEFAULT_VARIANTS})",
    )
    parser.add_argument(
        "--k",
        type=int_csv,
        default=[4],
        help="look-aheads of the speculative rows; each row shows its fastest (default 4)",
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=None,
        metavar="SHAPE",
        help=f"also a token tree for a model draft (repeatable): {TREE_HELP}",
    )
    parser.add_argument(
        "--sample-temperature",
        type=float,
        default=0.7,
        help="the speculative-sampling row's temperature (default 0.7; 0 leaves it out)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--limit", type=int, default=None, help="scored prompts per category (default: all)"
    )
    parser.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="task problems of each kind (code, math; default all 40; 0: none)",
    )
    parser.add_argument("--categories", type=csv_list, default=None, help="comma-separated")
    parser.add_argument("--prompts", default=None, help="JSONL file (ours or Spec-Bench format)")
    parser.add_argument(
        "--calibration-prompts",
        type=int,
        default=2,
        help="the last N prompts of each category: the pruning's calibration text, never "
        "scored (default 2)",
    )
    parser.add_argument("--no-chat", dest="chat", action="store_false", help="raw prompts")
    parser.add_argument("--dtype", default="bfloat16", help="the reference's dtype")
    parser.add_argument("--device", default=None)
    add_kernel_arg(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="output folder (default runs/compare-TIME)")
    parser.set_defaults(func=handle_compare, chat=True)


def handle_compare(args: argparse.Namespace) -> int:
    from specdecode.bench.compare import CompareConfig, run_compare
    from specdecode.bench.compare_report import main_table

    config = CompareConfig(
        target=args.target,
        draft=args.draft,
        variants=args.variants,
        ks=args.k,
        trees=args.tree or [],
        sample_temperature=args.sample_temperature,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        tasks=args.tasks,
        categories=args.categories,
        prompts_file=args.prompts,
        calibration_prompts=args.calibration_prompts,
        chat=args.chat,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        out=args.out or time.strftime("runs/compare-%Y%m%d-%H%M%S"),
        command=shlex.join(["specdecode", *getattr(args, "argv", [])]),
    )
    config.validate()  # every bad option fails before a model is loaded
    result = run_compare(config)
    print(main_table(result))
    print(f"\nreport: {config.out}/report.md (compare.json, results.jsonl, plot beside it)")
    return 0
