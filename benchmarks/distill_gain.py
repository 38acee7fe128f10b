"""What a distilled draft gained, measured on the prompts its training never saw: acceptance
rate, mean acceptance length τ and speedup of `distilled:DIR` against the draft it was trained
from, per category, for chains and trees, in one `specdecode bench` run (the same target, the
same prompts, interleaved; greedy outputs checked against the target alone).

    python -m benchmarks.distill_gain runs/distill --quantization int4 \
        --k 3,4 --tree dynamic:5,6,2,0.3 --tree dynamic:11,8,3,0.2,0.05 --out runs/distill-gain

The held-out prompts are DIR/distill.json's (`data.heldout_prompt_ids`, from its prompt file or
the built-in suite), written to OUT/heldout.jsonl; the target is the one distilled for unless
--target says otherwise. `--quantization int4` runs both drafts on 4-bit weights (the distilled
one quantized after its adapter is merged). Writes the bench's files (results.jsonl, report.md,
...) and gain.md / gain.json: per category and setting, both drafts' α, τ and speedup, the
difference in α and the ratio of speedups, and for the best tree of each draft; and whether the
issue's bar is met in the categories where the original draft is unsure (α up by >= 0.10, the
best tree >= 1.2x). `--dry-run` prints the plan without loading a model.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from specdecode.bench.runner import BenchConfig, run_bench
from specdecode.data.suites import load_suite
from specdecode.models.adapters import read_result

LOW_ACCEPTANCE = ("chat", "creative_writing", "translation", "question_answering")
ALPHA_GAIN, TREE_RATIO = 0.10, 1.2  # the bar (issue 27)


def heldout_prompts(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out prompts of a distillation, as suite lines (ours: id, category, turns)."""
    data = record["data"]
    wanted = data["heldout_prompt_ids"]
    if not wanted:
        raise SystemExit(
            "the distillation held no prompts out (--holdout 0): nothing to measure on"
        )
    by_id = {p.id: p for p in load_suite(data["source"])}
    missing = [i for i in wanted if i not in by_id]
    if missing:
        raise SystemExit(
            f"held-out prompt {missing[0]!r} is not in {data['source'] or 'the suite'}"
        )
    return [{"id": i, "category": by_id[i].category, "turns": by_id[i].turns} for i in wanted]


def _rate(row: dict[str, Any] | None, name: str) -> float | None:
    return None if row is None else row.get(name)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _diff(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def gain_table(summary: dict[str, Any], original: str, distilled: str) -> list[dict[str, Any]]:
    """Per category (and `all`) and setting (`k=N` / `tree=SHAPE`, and `best tree`): both
    drafts' α, τ and speedup, α's difference and the speedups' ratio (distilled / original)."""
    rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for row in summary["rows"]:
        if row["method"] != "spec" or row["draft"] not in (original, distilled):
            continue
        setting = f"tree={row['tree']}" if row["tree"] else f"k={row['k']}"
        if row["k_policy"] != "fixed" and not row["tree"]:
            setting += f" ({row['k_policy']})"
        side = "original" if row["draft"] == original else "distilled"
        rows.setdefault((row["category"], setting), {})[side] = row
    for category in dict.fromkeys(c for c, _ in rows):  # the best tree of each draft
        for side in ("original", "distilled"):
            trees = [
                pair[side]
                for (c, s), pair in rows.items()
                if c == category
                and s.startswith("tree=")
                and pair.get(side)
                and pair[side]["speedup"] is not None
            ]
            if trees:
                best = max(trees, key=lambda r: r["speedup"])
                rows.setdefault((category, "best tree"), {})[side] = best
    table = []
    for (category, setting), pair in rows.items():
        o, d = pair.get("original"), pair.get("distilled")
        entry = {"category": category, "setting": setting}
        for name, key in (
            ("alpha", "acceptance_rate"),
            ("tau", "mean_acceptance_length"),
            ("speedup", "speedup"),
        ):
            entry[f"{name}_original"], entry[f"{name}_distilled"] = _rate(o, key), _rate(d, key)
        entry["alpha_gain"] = _diff(entry["alpha_distilled"], entry["alpha_original"])
        entry["speedup_ratio"] = _ratio(entry["speedup_distilled"], entry["speedup_original"])
        if setting == "best tree":
            entry["trees"] = [o["tree"] if o else None, d["tree"] if d else None]
        table.append(entry)
    order = list(dict.fromkeys(e["category"] for e in table))
    kinds = ("k=", "tree=", "best tree")
    table.sort(
        key=lambda e: (
            order.index(e["category"]),
            [e["setting"].startswith(k) for k in kinds].index(True),
        )
    )
    return table


def verdicts(table: list[dict[str, Any]]) -> list[str]:
    """The issue's bar, per low-acceptance category that was measured."""
    lines = []
    for category in LOW_ACCEPTANCE:
        chains = [e for e in table if e["category"] == category and e["setting"].startswith("k=")]
        best = next(
            (e for e in table if e["category"] == category and e["setting"] == "best tree"), None
        )
        if not chains and best is None:
            continue
        gains = [e["alpha_gain"] for e in chains if e["alpha_gain"] is not None]
        if best and best["alpha_gain"] is not None:
            gains.append(best["alpha_gain"])
        alpha_ok = bool(gains) and min(gains) >= ALPHA_GAIN
        tree_ok = best is not None and (best["speedup_ratio"] or 0) >= TREE_RATIO
        lines.append(
            f"{category}: α gain {', '.join(map(_signed, gains)) or '-'} "
            f"({'met' if alpha_ok else 'not met'}: >= {ALPHA_GAIN:+.2f}); best tree "
            f"{_fmt(best['speedup_ratio'] if best else None, 'x')} "
            f"({'met' if tree_ok else 'not met'}: >= {TREE_RATIO}x)"
        )
    return lines


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _fmt(value: float | None, suffix: str = "", digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def render(table: list[dict[str, Any]], original: str, distilled: str) -> str:
    lines = [
        f"Distilled draft `{distilled}` against `{original}`, on held-out prompts.",
        "",
        "| category | setting | α orig | α dist | Δα | τ orig | τ dist | speedup orig | "
        "speedup dist | dist / orig |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in table:
        setting = e["setting"]
        if setting == "best tree":
            setting = f"best tree ({e['trees'][0]} / {e['trees'][1]})"
        lines.append(
            f"| {e['category']} | {setting} | {_fmt(e['alpha_original'])} | "
            f"{_fmt(e['alpha_distilled'])} | "
            f"{_signed(e['alpha_gain'])} | "
            f"{_fmt(e['tau_original'])} | {_fmt(e['tau_distilled'])} | "
            f"{_fmt(e['speedup_original'], 'x')} | {_fmt(e['speedup_distilled'], 'x')} | "
            f"{_fmt(e['speedup_ratio'], 'x')} |"
        )
    bar = verdicts(table)
    if bar:
        lines += ["", "The issue's bar where the original draft is unsure:", ""]
        lines += [f"- {line}" for line in bar]
    return "\n".join(lines)


def plan(args: argparse.Namespace) -> tuple[BenchConfig, dict[str, Any], list[dict[str, Any]]]:
    record = read_result(args.dir)
    prompts = heldout_prompts(record)
    quant = "" if args.quantization == "none" else f":{args.quantization}"
    original = f"{record['draft']}{quant}"
    distilled = f"distilled:{args.dir}{quant}"
    out = Path(args.out or time.strftime("runs/distill-gain-%Y%m%d-%H%M%S"))
    config = BenchConfig(
        target=args.target or record["target"],
        drafts=[original, distilled],
        methods=["ar", "spec"],
        ks=[int(k) for k in args.k.split(",") if k.strip()],
        policies=["fixed"],  # acceptance per k: chains of that k every step
        trees=args.tree or [],
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        prompts_file=str(out / "heldout.jsonl"),
        dtype=args.dtype,
        device=args.device,
        share_prefill=args.share_prefill,
        out=str(out),
        command=shlex.join([sys.executable, *sys.argv]),
    )
    config.validate()
    return config, record, prompts


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="a finished `specdecode distill --out DIR`")
    parser.add_argument("--target", default=None, help="default: the target distilled for")
    parser.add_argument("--quantization", choices=("none", "int8", "int4"), default="none")
    parser.add_argument("--k", default="4", help="chain look-aheads, comma-separated (4)")
    parser.add_argument(
        "--tree",
        action="append",
        default=None,
        help="tree shape (repeatable; default dynamic:5,6,2,0.3; none: chains only)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None)
    parser.add_argument("--share-prefill", action="store_true")
    parser.add_argument("--out", default=None, help="default runs/distill-gain-TIME")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, load nothing")
    args = parser.parse_args(argv)
    if args.tree is None:
        args.tree = ["dynamic:5,6,2,0.3"]
    elif args.tree == ["none"]:
        args.tree = []
    try:
        config, record, prompts = plan(args)
    except ValueError as err:
        raise SystemExit(f"distill_gain: {err}") from None
    original, distilled = config.drafts
    categories = dict.fromkeys(p["category"] for p in prompts)
    print(
        f"{len(prompts)} held-out prompts ({', '.join(categories)}), target {config.target}, "
        f"drafts {original} and {distilled}, k {config.ks}, trees {config.trees or 'none'}",
        file=sys.stderr,
    )
    if args.dry_run:
        print(
            json.dumps({"bench": config.__dict__, "prompts": [p["id"] for p in prompts]}, indent=1)
        )
        return None
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    summary = run_bench(config)
    table = gain_table(summary, original, distilled)
    text = render(table, original, distilled)
    (out / "gain.md").write_text(text + "\n")
    result = {
        "distillation": str(args.dir),
        "original": original,
        "distilled": distilled,
        "training": {k: record["training"][k] for k in ("steps", "tokens", "seconds")},
        "gain": table,
        "bar": verdicts(table),
    }
    (out / "gain.json").write_text(json.dumps(result, indent=1))
    print(text)
    print(f"\n{out}/gain.md, gain.json; the bench's report: {out}/report.md")
    return result


if __name__ == "__main__":
    main()
