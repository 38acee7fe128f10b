"""The draft vocabulary (models/draft_vocab.py) side by side with the whole output layer.

    python lab/probes/draft_vocab.py --sizes all,65536,32768 --limit 2 --out runs/draft-vocab

Loads the target once and the draft once per size (`all`: every id), then per prompt of the
built-in suite (or `--prompts FILE`; `--limit` per category, interleaved by category), in an order rotated from
prompt to prompt, runs the target alone and each draft's chain (`--k`) and tree (`--tree`,
`none` for chains only), greedy, `--max-new-tokens`. Prints and writes (`--out`: results.json,
report.md):
- coverage: the share of the target's own tokens (its greedy output alone) inside each draft
  vocabulary, per category: what a draft vocabulary can never propose;
- a draft forward's ms per size (one row, the median of `--repeats` forwards, sizes alternated);
- decode tokens/s (the tokens after the first over the time after it) per setting, its geometric
  mean, the paired ratio to the target alone, and whether each output is the target's own.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specdecode.bench.methods import MethodRunner, Setting
from specdecode.bench.serve_report import table
from specdecode.data.suites import interleave_by_category, load_suite
from specdecode.drafters import resolve_draft
from specdecode.models.draft_vocab import DraftVocabHead, kept_count
from specdecode.models.lean import draft_cache
from specdecode.models.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks
from benchmarks import llamacpp_io as lio  # the CPU description every benchmark here prints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--sizes", default="all,65536,32768", help="draft vocabularies")
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--tree", default="dynamic:5,6,2,0.3", help="a tree shape, or none")
    parser.add_argument("--prompts", type=Path, default=None, help="a suite file (default: ours)")
    parser.add_argument("--limit", type=int, default=2, help="prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30, help="draft forwards per size")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def draft_forward_ms(drafts: dict[str, Any], repeats: int, vocab: int) -> dict[str, float]:
    """One-row draft forward per size (after a prefill of 120 random ids below `vocab`), the
    sizes alternated forward by forward."""
    caches = {label: draft_cache(d.model) for label, d in drafts.items()}
    ids = torch.randint(0, vocab, (120 + repeats,), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = defaultdict(list)
    with torch.inference_mode():
        for cache in caches.values():
            cache.forward(ids[:120], last_only=True)
        for i in range(repeats):
            for label, cache in caches.items():
                start = time.perf_counter()
                cache.forward(ids[120 + i : 121 + i])
                times[label].append((time.perf_counter() - start) * 1e3)
                cache.rollback(120)
    return {label: statistics.median(t) for label, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    target = load_model(args.target, role="target")
    drafts = {f"vocab {s}": resolve_draft(args.draft, target, draft_vocab=s) for s in sizes}
    runner = MethodRunner(target, drafts)
    settings = {"target alone": Setting("ar")}
    for label in drafts:
        settings[f"{label}, k={args.k}"] = Setting("spec", label, args.k, "fixed", None)
        if args.tree != "none":
            settings[f"{label}, tree {args.tree}"] = Setting("spec", label, 2, "fixed", args.tree)
    names = list(settings)
    prompts = interleave_by_category(load_suite(args.prompts, None, args.limit))
    encoded = [(p, runner.ar_engine.encode_prompt(p.turns[0], chat=True)) for p in prompts]
    for name in names:  # warm-up
        runner.run(settings[name], encoded[0][1], 16)
    vocab = int(target.model.get_output_embeddings().out_features)
    forward_ms = draft_forward_ms(drafts, args.repeats, min(vocab, 30000))

    rates: dict[str, dict[str, float]] = defaultdict(dict)
    same: dict[str, int] = defaultdict(int)
    outputs: dict[str, tuple[str, list[int]]] = {}
    for i, (prompt, ids) in enumerate(tqdm(encoded, desc="prompts", file=sys.stderr)):
        tokens = {}
        for name in names[i % len(names) :] + names[: i % len(names)]:
            out = runner.run(settings[name], ids, args.max_new_tokens)
            decode_s = out.wall_time_s - out.ttft_s
            rates[name][prompt.id] = (len(out.token_ids) - out.first_chunk) / decode_s
            tokens[name] = out.token_ids
        outputs[prompt.id] = (prompt.category, tokens["target alone"])
        for name in names:
            same[name] += tokens[name] == tokens["target alone"]

    coverage: dict[str, dict[str, float]] = {}
    for size in sizes:
        head = drafts[f"vocab {size}"].model.get_output_embeddings()  # the ids it keeps
        kept = set(head.keep.tolist()) if isinstance(head, DraftVocabHead) else None
        by_category: dict[str, list[bool]] = defaultdict(list)
        for category, toks in outputs.values():
            by_category[category] += [kept is None or t in kept for t in toks]
            by_category["all"] += [kept is None or t in kept for t in toks]
        coverage[size] = {c: sum(v) / len(v) for c, v in by_category.items()}

    base = rates["target alone"]
    rows = {
        name: {
            "tok_s": geomean(list(rates[name].values())),
            "vs_target": geomean([rates[name][p] / base[p] for p in base]),
            "identical": same[name],
        }
        for name in names
    }
    categories = sorted({c for c, _ in outputs.values()})
    machine = lio.machine(torch.get_num_threads())
    cpu = machine["cpu"]
    lines = [
        "# The draft vocabulary",
        "",
        f"Command: `python {' '.join(sys.argv if argv is None else ['draft_vocab.py', *argv])}`  ",
        f"Started {started}; CPU {cpu['model_name']} (family "
        f"{cpu.get('family')}, model {cpu.get('model')}), {machine['threads']} threads, flags "
        f"{', '.join(cpu.get('flags', []))}; target `{args.target}`, draft `{args.draft}`; "
        f"{len(prompts)} prompts, greedy, at most {args.max_new_tokens} new tokens.",
        "",
        *table(
            ("draft vocabulary", "ids kept", "one-row draft forward, ms", "target tokens inside"),
            [
                [
                    size,
                    str(kept_count(drafts[f"vocab {size}"].model) or vocab),
                    f"{forward_ms[f'vocab {size}']:.2f}",
                    f"{coverage[size]['all']:.3f}",
                ]
                for size in sizes
            ],
        ),
        "",
        "Target tokens inside, per category: "
        + "; ".join(
            f"{size}: " + ", ".join(f"{c} {coverage[size][c]:.3f}" for c in categories)
            for size in sizes
            if size != "all"
        ),
        "",
        *table(
            ("setting", "decode tok/s (geomean)", "vs target alone (paired)", "identical"),
            [
                [
                    name,
                    f"{row['tok_s']:.2f}",
                    f"{row['vs_target']:.3f}x",
                    f"{row['identical']}/{len(prompts)}",
                ]
                for name, row in rows.items()
            ],
        ),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.md").write_text(report)
        results = {
            "argv": sys.argv if argv is None else argv,
            "machine": machine,
            "draft_forward_ms": forward_ms,
            "coverage": coverage,
            "rows": rows,
            "rates": rates,
        }
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
