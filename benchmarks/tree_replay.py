"""Replay greedy chains and token trees against the target's recorded answers: τ, draft forwards
and verified rows per step, exact, with no target forward.

    python -m benchmarks.tree_replay runs/ar --draft qwen2.5-coder-0.5b-instruct:int4 \
        --setting k=3 --setting tree=dynamic:5,6,2,0.2 --c C --v V1,V2,V3,V4,V5,V6

Greedy speculative decoding emits the target's greedy answer (exactly in float32; in bfloat16 up
to near-ties, where a real run may continue differently), and a drafted token is accepted iff it
is the answer's next token: so the `ar` answers a `specdecode bench` run recorded
(results.jsonl, any run with `ar`) say what every step of any greedy drafter accepts. This runs
the real drafters (their draft forwards) and the core's greedy verification on one-hot "target
logits" built from the answer (`specdecode.auto.replay`), and counts per step: tokens emitted
(τ), draft forwards and the rows the target would verify. With a measured draft cost `--c` (a draft forward / a one-token
target forward) and verification costs `--v` (v(1), v(2), ... from verify_cost.py or a bench
report), it also prints the speedup those counts imply: τ / (c · forwards + v(rows)), a model
(no clock is read), for comparing settings; only `specdecode bench` measures speed. `--v` may be
given several times (`NAME=V1,V2,...`): one replay, a modeled speedup per cost scenario (say,
measured costs beside a bound on what a faster kernel could reach). A draft forward costs c
whatever it holds unless `--draft-v` gives its cost over n rows in one-row draft forwards (a tree
level of several nodes costs more than one node on a real kernel): then c · Σ draft-v(rows) per
step (the draft's prompt prefill is no draft forward, as in `specdecode bench`). The run's own
prompts, target and chat setting (its run.json), first turns.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from specdecode import SpeculativeDecoder, load_model
from specdecode.auto.replay import replay
from specdecode.data.suites import load_suite
from specdecode.drafters import resolve_draft
from specdecode.drafters.tree_shape import parse_tree_spec


def recorded_answers(run: Path) -> tuple[dict[str, Any], dict[str, tuple[int, list[int]]]]:
    """The run's bench config and, per prompt id, (prompt tokens, the token ids `ar` generated)
    in its first turn. SystemExit when the run cannot be replayed."""
    config = json.loads((run / "run.json").read_text())["config"]
    if config["temperature"]:
        raise SystemExit(f"{run} sampled (temperature {config['temperature']}): greedy runs only")
    answers = {}
    with open(run / "results.jsonl") as f:
        for line in f:
            record = json.loads(line)
            if record["method"] == "ar" and record["turn"] == 0:
                answers[record["prompt_id"]] = (record["prompt_tokens"], record["token_ids"])
    if not answers:
        raise SystemExit(f"{run}/results.jsonl has no `ar` record: bench with --methods ar")
    return config, answers


def parse_costs(text: str, index: int) -> tuple[str, list[float]]:
    """`[NAME=]V1,V2,...` -> (NAME, [v(1), v(2), ...]); unnamed scenarios are numbered."""
    name, _, values = text.rpartition("=")
    try:
        v = [float(x) for x in values.split(",")]
    except ValueError:
        raise SystemExit(f"--v {text!r}: [NAME=]comma-separated numbers v(1),v(2),...") from None
    return name or f"v{index + 1}", v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a bench output folder with `ar` records")
    parser.add_argument("--target", default=None, help="default: the run's")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--setting", action="append", required=True, help="k=N or tree=SHAPE")
    parser.add_argument("--limit", type=int, default=None, help="prompts per category")
    parser.add_argument("--c", type=float, default=None, help="draft / target forward time")
    parser.add_argument(
        "--v",
        action="append",
        default=[],
        help="[NAME=]v(1),v(2),...: verification cost per rows; repeatable, one model each",
    )
    parser.add_argument(
        "--draft-v",
        default=None,
        help="d(1),d(2),...: a draft forward over n rows / over one (default 1 for any n)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    scenarios = dict(parse_costs(text, i) for i, text in enumerate(args.v))
    draft_v = parse_costs(args.draft_v, 0)[1] if args.draft_v else None
    if bool(scenarios) != (args.c is not None):
        raise SystemExit("--c and --v go together (the modeled speedup needs both)")
    if len(scenarios) != len(args.v):
        raise SystemExit("--v: each scenario needs its own NAME")

    for setting in args.setting:  # every typo before the models load
        kind, _, value = setting.partition("=")
        if kind == "tree":
            try:
                parse_tree_spec(value)
            except ValueError as err:
                raise SystemExit(str(err)) from None
        elif kind != "k" or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--setting {setting!r}: k=N or tree=SHAPE")
    config, answers = recorded_answers(args.run)
    prompts = [p for p in load_suite(config["prompts_file"], limit=args.limit) if p.id in answers]
    target = load_model(args.target or config["target"], dtype=args.dtype, device="cpu")
    draft = resolve_draft(args.draft, target, dtype=args.dtype, device="cpu")
    print(f"{len(prompts)} prompts from {args.run}, draft {args.draft}")
    if scenarios:
        print(f"modeled speedup with c = {args.c}, v: " + " / ".join(scenarios))
    print(
        "\n| setting | τ | draft forwards / step | rows / step | modeled speedup | per category: τ (modeled) |"
    )
    print("|---|---|---|---|---|---|")
    for setting in args.setting:
        kind, _, value = setting.partition("=")
        k = int(value) if kind == "k" else 1
        engine = SpeculativeDecoder(
            target, draft, k=k, k_policy="fixed", tree=value if kind == "tree" else None
        )
        # per category: emitted, steps, draft forwards, rows, then the modeled cost per scenario
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0, 0] + [0.0] * len(scenarios))
        for prompt in prompts:
            text = prompt.turns[0]
            chat = config["chat"]
            ids = engine.encode_prompt([{"role": "user", "content": text}] if chat else text, chat)
            n_prompt, answer = answers[prompt.id]
            if len(ids) != n_prompt:
                raise SystemExit(f"{prompt.id}: {len(ids)} prompt tokens, the run had {n_prompt}")
            for emitted, draft_rows, rows in replay(engine, ids, answer, k):
                forwards = len(draft_rows)
                if draft_v is not None:
                    if max(draft_rows, default=1) > len(draft_v):
                        raise SystemExit(
                            f"--draft-v: d(1..{len(draft_v)}); a draft forward took "
                            f"{max(draft_rows)} rows"
                        )
                    forwards = sum(draft_v[n - 1] for n in draft_rows)
                for key in (prompt.category, "all"):
                    total = totals[key]
                    total[0] += emitted
                    total[1] += 1
                    total[2] += len(draft_rows)
                    total[3] += rows
                    for i, (name, v) in enumerate(scenarios.items()):
                        if rows > len(v):
                            raise SystemExit(f"--v {name}: v(1..{len(v)}); a step verified {rows}")
                        total[4 + i] += args.c * forwards + v[rows - 1]
        modeled = {
            key: " / ".join(f"{t[0] / cost:.2f}x" for cost in t[4:]) or "-"
            for key, t in totals.items()
        }
        emitted, steps, forwards, rows = totals.pop("all")[:4]
        cells = ", ".join(f"{key} {t[0] / t[1]:.2f} ({modeled[key]})" for key, t in totals.items())
        print(
            f"| {setting} | {emitted / steps:.2f} | {forwards / steps:.2f} | {rows / steps:.2f} "
            f"| {modeled['all']} | {cells} |"
        )


if __name__ == "__main__":
    main()
