"""Command line: the root `specdecode` command, `generate` and `demo`; argparse -> typed calls
into the package. The other subcommands add their own parsers; what they share is cli_args.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from specdecode.cli_args import (
    TREE_HELP,
    add_drafting_args,
    add_generation_config_arg,
    add_kernel_arg,
    add_model_args,
    add_policy_args,
    engine_from_args,
)


def _positive_int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _require_positive(args: argparse.Namespace, *names: str) -> None:
    """Fail on counts < 1 before any model is loaded (unset options are left to defaults)."""
    for name in names:
        value = getattr(args, name)
        if isinstance(value, int) and value < 1:  # "auto" (--k) is resolved later
            raise ValueError(f"{name} must be an integer >= 1 (got {value})")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy; default: the model's generation config's, else 0",
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="default: the model's, else no top-k"
    )
    parser.add_argument(
        "--top-p", type=float, default=None, help="default: the model's, else no top-p"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")


def _cmd_generate(args: argparse.Namespace) -> int:
    from specdecode.core.request import SamplingDefaults

    # validate cheap arguments before loading any model
    SamplingDefaults().resolve(args.temperature, args.top_k, args.top_p)
    _require_positive(args, "k", "max_new_tokens")
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    if not prompt:
        raise ValueError("the prompt is empty")
    engine = engine_from_args(args)
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        chat=args.chat,
    )
    if args.json:
        print(json.dumps(engine.generate(prompt, **options).to_dict()))
        return 0
    result = engine.generate(prompt, **options)
    print(result.text if result.text is not None else " ".join(map(str, result.token_ids)))
    print(_summary_line(result.stats), file=sys.stderr)
    return 0


def _summary_line(stats) -> str:
    parts = [f"{stats.new_tokens} tokens in {stats.wall_time_s:.2f}s"]
    if stats.tokens_per_s:
        parts.append(f"{stats.tokens_per_s:.1f} tokens/s")
    if stats.acceptance_rate is not None:
        parts.append(f"acceptance {stats.acceptance_rate:.2f}")
        parts.append(f"mean acceptance length {stats.mean_acceptance_length:.2f}")
    return ", ".join(parts)


def _cmd_demo(args: argparse.Namespace) -> int:
    from specdecode import demo

    _require_positive(args, "k", "max_new_tokens", "limit")
    quick = args.quick
    target = args.target or (demo.QUICK_TARGET if quick else demo.DEFAULT_TARGET)
    draft = args.draft or (demo.QUICK_DRAFT if quick else demo.DEFAULT_DRAFT)
    k = args.k if args.k is not None else (demo.QUICK_K if quick else demo.DEFAULT_K)
    if args.tree is not None:
        tree = None if args.tree == "none" else args.tree
    else:  # the default pair drafts what this machine's calibration picks; a chosen draft or
        # k runs a chain
        default = not (quick or args.draft or args.k is not None)
        tree = demo.AUTO if default else None
    demo.main_demo(
        target,
        draft,
        k=k,
        tree=tree,
        max_new_tokens=args.max_new_tokens or (48 if quick else 64),
        dtype=args.dtype,
        device=args.device,
        limit=args.limit or (4 if quick else None),
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdecode", description="Lossless speculative decoding for Hugging Face models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(gen)
    add_drafting_args(gen)
    _add_sampling_args(gen)
    add_generation_config_arg(gen, "they mean greedy, no top-k, no top-p")
    add_policy_args(gen)
    gen.add_argument(
        "--category",
        default=None,
        help="apply the --config file's per_category settings for this prompt kind (from tune)",
    )
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-ids", type=_positive_int_list, help="comma-separated token ids")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(func=_cmd_generate)

    dem = sub.add_parser(
        "demo",
        help="the target alone vs speculative decoding on built-in prompts (fetches models)",
    )
    dem.add_argument(
        "--target",
        default=None,
        help="default: qwen2.5-coder-1.5b-instruct (MODEL:int8 / MODEL:int4: quantized)",
    )
    dem.add_argument(
        "--draft",
        default=None,
        help="default: qwen2.5-coder-0.5b-instruct:int4 where the CPU kernel runs, else in "
        "bfloat16 (quick: ngram)",
    )
    dem.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run on smollm2-135m-instruct (a small download)",
    )
    dem.add_argument(
        "--k",
        type=int,
        default=None,
        help="tokens drafted per step of a chain (default 4; quick: 2)",
    )
    dem.add_argument(
        "--tree",
        default=None,
        metavar="SHAPE",
        help=f"draft a token tree ({TREE_HELP}), 'none' for a chain or 'auto'; default with "
        "the default draft and k: auto, the tree or chain this machine's calibration expects to "
        "be fastest (`specdecode calibrate`, measured on first use), else a chain",
    )
    dem.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (quick: 48)")
    dem.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    dem.add_argument("--dtype", default="bfloat16")
    dem.add_argument("--device", default=None)
    add_kernel_arg(dem)
    dem.set_defaults(func=_cmd_demo)

    try:
        from specdecode.models.cli_models import add_models_parser
    except ImportError:  # pragma: no cover - optional while presets are absent
        pass
    else:
        add_models_parser(sub)
    from specdecode.server.cli_serve import add_serve_parser

    add_serve_parser(sub)  # imports nothing of the server until `serve` runs
    from specdecode.server.cli_run_batch import add_run_batch_parser

    add_run_batch_parser(sub)  # likewise
    from specdecode.bench.cli_bench import add_bench_parsers
    from specdecode.bench.cli_calibrate import add_calibrate_parser

    add_bench_parsers(sub)
    add_calibrate_parser(sub)
    from specdecode.bench.cli_compare import add_compare_parser

    add_compare_parser(sub)
    from specdecode.bench.cli_bench_serve import add_bench_serve_parser

    add_bench_serve_parser(sub)

    from specdecode.distill.cli_distill import add_distill_parser

    add_distill_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with benchmark results
    if getattr(args, "kernel", None):
        # every load_model of this command (target, draft, bench, tune, serve) reads it
        os.environ["SPECDECODE_KERNEL"] = args.kernel
    if getattr(args, "draft_vocab", None):
        from specdecode.core.draft_spec import DRAFT_VOCAB_ENV

        # every resolve_draft of this command reads it
        os.environ[DRAFT_VOCAB_ENV] = args.draft_vocab
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        # a user's mistake: one line, exit status 2, no traceback
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        from specdecode.models.fetch import FetchError

        if not isinstance(err, FetchError):
            raise
        print(f"specdecode: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
