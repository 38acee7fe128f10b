"""`specdecode calibrate`: this machine's calibration of a target/draft pair (auto/calibrate.py),
measured where it is not cached, printed as tables or (`--json`) as its record."""

from __future__ import annotations

import argparse
import json

from specdecode.auto.calibration import Calibration
from specdecode.cli_args import add_kernel_arg


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure (once, cached) what k and tree pay on this machine for a target/draft pair",
        description="Measure the target's v(n) for n = 1..16 new tokens, the draft's forward, and "
        "the acceptance of a short greedy chain run on three bench-suite prompts; replay candidate "
        "trees on its answers; print the chain k and the tree shape expected to be fastest. The "
        "record is cached per machine and read by demo, generate/serve --k auto / --tree auto.",
    )
    parser.add_argument("--target", required=True, help="target model (as for generate)")
    parser.add_argument(
        "--draft", required=True, help="draft: a model (MODEL:int8 / MODEL:int4), early-exit:N, "
        "eagle3:DIR (chains only) or ngram[:MIN-MAX]",
    )  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float32, float16")
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N (default: cuda if present)"
    )
    add_kernel_arg(parser)
    parser.add_argument("--force", action="store_true", help="measure again even if cached")
    parser.add_argument("--json", action="store_true", help="print the record as JSON")
    parser.set_defaults(func=handle_calibrate)
    return parser


def handle_calibrate(args: argparse.Namespace) -> int:
    from specdecode.auto.calibrate import calibrated
    from specdecode.core.draft_spec import DraftSpec
    from specdecode.drafters import resolve_draft
    from specdecode.models.loading import load_model

    DraftSpec.parse(args.draft)  # a bad draft fails before any model loads
    target = load_model(args.target, dtype=args.dtype, device=args.device)
    draft = resolve_draft(args.draft, target, dtype=args.dtype, device=args.device)
    calibration, path = calibrated(target, draft, args.target, args.draft, force=args.force)
    if args.json:
        print(json.dumps(calibration.to_dict(), indent=1))
    else:
        print(render(calibration))
        print(f"\ncached in {path}")
    return 0


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def render(c: Calibration) -> str:
    """The calibration as text: key, costs, acceptance, every candidate and the choice."""
    m = c.machine
    flags = " ".join(m.flags) or "none of avx2/fma/avx512"
    cpu_id = f"family {m.cpu_family} model {m.cpu_model} stepping {m.cpu_stepping}"
    lines = [
        f"Calibration of {c.target} with draft {c.draft}, {c.dtype}, measured {c.measured_at} "
        f"in {c.seconds:.0f} s",
        f"machine: {m.cpu} ({cpu_id}), flags {flags}, {m.threads} threads, {m.device}; torch "
        f"{m.torch}, transformers {m.transformers}, specdecode {m.specdecode}; kernels: target "
        f"{m.target_kernel}, draft {m.draft_kernel} ({m.draft_forward} forward)",
        "",
        f"Forwards over n new tokens after {c.prefix} cached ones (median of {c.repeats}):",
        "",
        "| n | target ms | v(n) | draft ms |",
        "|---|---|---|---|",
    ]
    v = c.v
    for n, seconds in c.target_forward_s.items():
        draft = _ms(c.draft_forward_s[n]) if c.draft_forward_s else "-"
        lines.append(f"| {n} | {_ms(seconds)} | {v[n]:.2f} | {draft} |")
    chain = c.chain
    acceptance = " ".join("-" if a is None else f"{a:.2f}" for a in chain.per_position_acceptance)
    lines += [
        "",
        f"Chain run at k = {chain.k} on {', '.join(chain.prompts)}: {chain.new_tokens} tokens in "
        f"{chain.steps} steps; per-position acceptance {acceptance}; step overhead "
        f"{_ms(chain.step_overhead_s)} ms.",
        "",
        "Expected per step (chains from the chain run's acceptance, trees replayed on its "
        "answers); cost = draft forwards x draft ms + v(verified) x one-token ms + overhead:",
        "",
        "| candidate | tokens / step | draft forwards / step | verified / step | ms / step | "
        "tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for cand in [*c.chains(), *c.tree_candidates()]:
        lines.append(
            f"| {cand.label} | {cand.tokens_per_step:.2f} | {cand.draft_forwards_per_step:.2f} "
            f"| {cand.verified_per_step:.2f} | {_ms(cand.seconds_per_step)} "
            f"| {cand.tokens_per_s:.1f} |"
        )
    best_chain, best_tree, best = c.best_chain(), c.best_tree(), c.best()
    lines += [
        "",
        f"The target alone: one one-token forward per token, {1 / c.one_token_s:.1f} tokens/s "
        "before its own step overhead.",
        f"Chosen: --k auto -> k = {best_chain.k}; --tree auto -> "
        f"{best_tree.tree if best_tree else 'none (no tree for this draft)'}; both, and the "
        f"demo -> {best.label}.",
    ]
    return "\n".join(lines)
