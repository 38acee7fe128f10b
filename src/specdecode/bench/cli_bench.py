"""`specdecode bench` and `specdecode report DIR`: argparse -> BenchConfig -> runner."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from specdecode.bench.methods import ALL_METHODS
from specdecode.cli_args import TREE_HELP, add_kernel_arg, csv_list, int_csv


def add_bench_parsers(subparsers: argparse._SubParsersAction) -> None:
    """`bench`, `tune` and `report` on the main command's subparsers."""
    _add_bench_parser(subparsers)
    _add_tune_parser(subparsers)
    report = subparsers.add_parser("report", help="re-render a saved benchmark's report")
    report.add_argument("dir", help="a folder written by `specdecode bench`")
    report.set_defaults(func=handle_report)


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="measure methods side by side on prompt suites (acceptance, speed, memory)",
        description="Run every requested method on the same prompts in one process, interleaved "
        "per prompt after a warm-up, and write results.jsonl, summary.json, report.md and plots.",
    )
    bench.add_argument(
        "--target",
        default=None,
        help="target model (quick: smollm2-135m-instruct); MODEL:int8 / MODEL:int4: on int8 / "
        "4-bit weights, then `ar` and the identity checks are that model's",
    )
    bench.add_argument(
        "--draft",
        action="append",
        default=None,
        help="draft (repeatable): a model (MODEL:int8 / MODEL:int4: on int8 / 4-bit weights), "
        "ngram[:MIN-MAX] or early-exit:N (quick: ngram)",
    )
    bench.add_argument(
        "--methods",
        type=csv_list,
        default=None,
        help=f"comma-separated, from {','.join(ALL_METHODS)} (default: all that apply)",
    )
    bench.add_argument("--k", type=int_csv, default=None, help="look-aheads (default 1,2,4,6,8)")
    bench.add_argument(
        "--hf-k",
        type=int_csv,
        default=None,
        help="k of HF's constant-k assisted and prompt-lookup settings (default: --k)",
    )
    bench.add_argument(
        "--k-policy",
        type=csv_list,
        default=None,
        help="comma-separated k policies for spec (default cost)",
    )
    bench.add_argument(
        "--tree",
        action="append",
        default=None,
        metavar="SHAPE",
        help=f"token tree for each model draft (repeatable): {TREE_HELP}",
    )
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    bench.add_argument("--top-k", type=int, default=None)
    bench.add_argument("--top-p", type=float, default=None)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (quick: 32)")
    bench.add_argument("--prompts", default=None, help="JSONL file (ours or Spec-Bench format)")
    bench.add_argument(
        "--categories", type=csv_list, default=None, help="comma-separated categories"
    )
    bench.add_argument("--limit", type=int, default=None, help="prompts per category (quick: 1)")
    bench.add_argument(
        "--turns", default="first", choices=["first", "all"], help="multi-turn prompts"
    )
    bench.add_argument(
        "--no-chat", dest="chat", action="store_false", help="raw prompts, no chat template"
    )
    bench.add_argument("--chat", dest="chat", action="store_true", help="chat template (default)")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument(
        "--share-prefill",
        action="store_true",
        help="prefill each prompt once and reuse the cache in ar, spec and hf-ar (HF's assisted "
        "and lookup methods cannot take it): TTFT and e2e rates then exclude that prefill",
    )
    bench.add_argument(
        "--dtype", default=None, help="default bfloat16 (quick: float32, exact identity to AR)"
    )
    bench.add_argument("--device", default=None)
    add_kernel_arg(bench)
    bench.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a run config (e.g. from `specdecode tune`): benchmark it as `spec[tuned]`, each "
        "category with its own settings, against ar (--methods or --draft add more); its target, "
        "dtype and device are the defaults",
    )
    bench.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="[LABEL=]URL",
        help="an OpenAI-compatible server to measure instead of loading models (repeatable: "
        "vLLM, SGLang, llama-server, `specdecode serve`): each is a setting; label the one that "
        "does not speculate `ar` for speedups and identity; acceptance from its /metrics",
    )
    bench.add_argument(
        "--model",
        default=None,
        help="with --server: the model to ask for (default: the one listed)",
    )
    bench.add_argument("--api-key", default=None, help="with --server: sent as a bearer token")
    bench.add_argument(
        "--timeout", type=float, default=600.0, help="with --server: seconds to wait for a server"
    )
    bench.add_argument("--out", default=None, help="output folder (default runs/bench-TIME)")
    bench.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: smollm2-135m-instruct, ngram draft, 1 prompt per category, k=2,4, "
        "32 new tokens, float32 (a few minutes on 2 cores)",
    )
    bench.set_defaults(func=handle_bench, chat=True)


def _add_tune_parser(subparsers: argparse._SubParsersAction) -> None:
    tune = subparsers.add_parser(
        "tune",
        help="recommend a drafter, k, policy or tree per category, predicted and then measured",
        description="Calibrate every candidate drafter once at k_max, predict the speedup of "
        "every k per category from measured acceptance and costs (k policies and trees: "
        "measured as they run), recommend, and check the overall recommendation on prompts the "
        "calibration did not see. Writes config.json (for --config), vllm.json, tune.md and "
        "tune.json.",
    )
    tune.add_argument(
        "--target", required=True, help="target model (MODEL:int8 / MODEL:int4: quantized)"
    )
    tune.add_argument(
        "--draft",
        action="append",
        required=True,
        help="candidate drafter (repeatable): a model (MODEL:int8 / MODEL:int4: on int8 / "
        "4-bit weights), ngram[:MIN-MAX] or early-exit:N",
    )
    tune.add_argument("--k-max", type=int, default=8, help="largest k considered (default 8)")
    tune.add_argument(
        "--k-policy",
        type=csv_list,
        default=None,
        help="adaptive k policies to try too, comma-separated (heuristic,cost), at k = k_max",
    )
    tune.add_argument(
        "--tree",
        action="append",
        default=None,
        metavar="SHAPE",
        help=f"token tree to try with each model draft (repeatable): {TREE_HELP}",
    )
    tune.add_argument(
        "--limit", type=int, default=2, help="prompts per category to calibrate (and validate)"
    )
    tune.add_argument("--categories", type=csv_list, default=None)
    tune.add_argument("--prompts", default=None, help="JSONL file (ours or Spec-Bench format)")
    tune.add_argument("--max-new-tokens", type=int, default=64)
    tune.add_argument("--no-chat", dest="chat", action="store_false")
    tune.add_argument("--dtype", default="bfloat16")
    tune.add_argument("--device", default=None)
    add_kernel_arg(tune)
    tune.add_argument("--no-validate", dest="validate", action="store_false")
    tune.add_argument(
        "--engine",
        choices=("specdecode", "vllm"),
        default="specdecode",
        help="whose speculative settings to tune: ours (default) or vLLM's, each candidate on a "
        "vLLM server of its own (--vllm-python), our n-gram and suffix drafters inside vLLM too",
    )
    tune.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="with --engine vllm: the python of the environment vLLM is installed in",
    )
    tune.add_argument(
        "--vllm-k",
        type=int_csv,
        default=None,
        help="with --engine vllm: the k of every candidate (default 2,4)",
    )
    tune.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="with --engine vllm: one more `vllm serve` argument (repeatable; "
        "--vllm-arg=--max-model-len --vllm-arg=4096)",
    )
    tune.add_argument("--out", default=None, help="output folder (default runs/tune-TIME)")
    tune.set_defaults(func=handle_tune, chat=True)


def handle_bench(args: argparse.Namespace) -> int:
    from specdecode.bench.runner import QUICK_DRAFTS, QUICK_TARGET, BenchConfig, run_bench
    from specdecode.core.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_k, args.top_p)  # bad values fail before loading
    if args.server:
        return _bench_servers(args)
    run = None
    if args.config:
        from specdecode.bench.methods import tuned_setting
        from specdecode.config import load_config

        run = load_config(args.config)
        tuned_setting(run)  # a config without a draft fails before loading
        args.target = args.target or run.target
        args.dtype = args.dtype or run.dtype
        args.device = args.device or run.device
    if args.target is None and not args.quick:
        raise ValueError("--target is required (or --quick, or a --config that names one)")
    config = BenchConfig(
        target=args.target or QUICK_TARGET,
        drafts=args.draft or (QUICK_DRAFTS if args.quick else []),
        methods=args.methods,
        ks=args.k or ([2, 4] if args.quick else [1, 2, 4, 6, 8]),
        policies=args.k_policy or ["cost"],
        trees=args.tree or [],
        hf_ks=args.hf_k,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens or (32 if args.quick else 64),
        prompts_file=args.prompts,
        categories=args.categories,
        limit=args.limit or (1 if args.quick else None),
        turns=args.turns,
        chat=args.chat,
        repeats=args.repeats,
        share_prefill=args.share_prefill,
        dtype=args.dtype or ("float32" if args.quick else "bfloat16"),
        device=args.device,
        config_file=args.config,
        out=args.out or time.strftime("runs/bench-%Y%m%d-%H%M%S"),
        command=shlex.join(["specdecode", *args.argv]),
    )
    config.validate()
    summary = run_bench(config)
    _print_headline(summary, config.out)
    return 0


# options that load or configure our engine, meaningless when servers are measured
_ENGINE_ONLY = (
    "target", "draft", "methods", "k", "hf_k", "k_policy", "tree", "top_k", "top_p",
    "share_prefill", "dtype", "device", "config", "quick", "kernel", "draft_vocab",
)  # fmt: skip


def _bench_servers(args: argparse.Namespace) -> int:
    from specdecode.bench.server_bench import ServerBenchConfig, run_server_bench

    given = [name for name in _ENGINE_ONLY if getattr(args, name, None) not in (None, False)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag} configures our engine: with --server the servers run as started")
    config = ServerBenchConfig(
        servers=args.server,
        out=args.out or time.strftime("runs/bench-%Y%m%d-%H%M%S"),
        model=args.model,
        api_key=args.api_key,
        prompts_file=args.prompts,
        categories=args.categories,
        limit=args.limit,
        turns=args.turns,
        chat=args.chat,
        max_new_tokens=args.max_new_tokens or 64,
        temperature=args.temperature,
        seed=args.seed,
        repeats=args.repeats,
        timeout_s=args.timeout,
        command=shlex.join(["specdecode", *args.argv]),
    )
    summary = run_server_bench(config)
    _print_headline(summary, config.out)
    return 0


def handle_tune(args: argparse.Namespace) -> int:
    from specdecode.bench.runner import BenchConfig
    from specdecode.bench.tune import render_tune, run_tune

    if args.engine == "vllm":
        return _tune_vllm(args)
    if args.vllm_python or args.vllm_k or args.vllm_arg:
        raise ValueError("--vllm-python, --vllm-k and --vllm-arg go with --engine vllm")
    if args.k_max < 1:
        raise ValueError(f"--k-max must be >= 1 (got {args.k_max})")
    config = BenchConfig(
        target=args.target,
        drafts=args.draft,
        ks=[args.k_max],
        policies=args.k_policy or ["fixed"],
        trees=args.tree or [],
        max_new_tokens=args.max_new_tokens,
        prompts_file=args.prompts,
        categories=args.categories,
        limit=args.limit,
        chat=args.chat,
        dtype=args.dtype,
        device=args.device,
        out=args.out or time.strftime("runs/tune-%Y%m%d-%H%M%S"),
        command=shlex.join(["specdecode", *args.argv]),
    )
    result = run_tune(config, args.k_max, validate=args.validate)
    print(render_tune(result))
    print(f"config: {config.out}/config.json (use with --config); details in {config.out}/")
    return 0


def _tune_vllm(args: argparse.Namespace) -> int:
    from specdecode.bench.tune_vllm import DEFAULT_KS, VllmTuneConfig, run_tune_vllm
    from specdecode.config import vllm_model
    from specdecode.core.draft_spec import ModelSpec

    if not args.vllm_python:
        raise ValueError(
            "--engine vllm needs --vllm-python PATH (the python of vLLM's environment)"
        )
    if args.tree or args.k_policy:
        raise ValueError("--tree and --k-policy are our engine's: vLLM drafts fixed-k chains")
    target = ModelSpec.parse(args.target, "target")
    if target.quantization:
        raise ValueError(
            f"--target {args.target}: vLLM loads {target.name} in {args.dtype}; our "
            f":{target.quantization} weights are this engine's (drop the suffix)"
        )
    config = VllmTuneConfig(
        python=args.vllm_python,
        target=vllm_model(target.name),
        drafts=args.draft,  # a preset draft: vLLM gets its converted folder (candidates)
        out=args.out or time.strftime("runs/tune-vllm-%Y%m%d-%H%M%S"),
        ks=args.vllm_k or list(DEFAULT_KS),
        prompts_file=args.prompts,
        categories=args.categories,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        dtype=args.dtype,
        vllm_args=args.vllm_arg,
        command=shlex.join(["specdecode", *args.argv]),
    )
    run_tune_vllm(config)
    print((Path(config.out) / "tune-vllm.md").read_text())
    print(f"details in {config.out}/ (report.md: every candidate, every category)")
    return 0


def handle_report(args: argparse.Namespace) -> int:
    from specdecode.bench.runner import rerender

    summary = rerender(args.dir)
    _print_headline(summary, args.dir)
    return 0


def _print_headline(summary: dict, out_dir: str) -> None:
    from specdecode.bench.report import overall_table

    print(overall_table(summary))
    print(f"\nreport: {out_dir}/report.md (results.jsonl, summary.json, plots beside it)")
