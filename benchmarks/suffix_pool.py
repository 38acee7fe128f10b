"""A batch job through one engine: the suffix pool of earlier outputs against each request alone.

The same task over different inputs (`--requests` of them: pull the fields of a short record out
as JSON) through one `SpeculativeDecoder` per setting, greedy: `suffix` (the pool on: each
request may draft from the outputs of those that finished before it) and `suffix:pool=off` (each
request alone). Without `--batch`, one request after another, the settings interleaved request
by request; with `--batch N`, each setting's job through `generate_batch` at N rows (a row that
ends hands its place to the next request, whose drafts may come from every output finished by
then), the settings one after the other. Prints and writes (OUT/pool.json, OUT/pool.md)
acceptance (accepted / drafted tokens), tokens per step and decode tokens/s per request index,
the first and last quarters side by side, each setting's whole job in tokens/s (with `--batch`),
and what the pool held at the end; every output is checked against the target alone.

    python -m benchmarks.suffix_pool --target qwen2.5-coder-1.5b-instruct:int4 --out runs/pool
    python -m benchmarks.suffix_pool --requests 32 --batch 8 --out runs/pool-batch
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from specdecode import SpeculativeDecoder, load_model
from specdecode.core.draft_spec import SuffixOptions
from specdecode.drafters import SuffixDrafter

NAMES = ["Ana", "Bruno", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana"]
CITIES = ["Lisbon", "Lyon", "Osaka", "Quito", "Tartu", "Accra", "Perth", "Bergen"]
JOBS = ["nurse", "welder", "teacher", "pilot", "chemist", "baker", "lawyer", "farmer"]


def task(i: int) -> str:
    """The i-th request: one record in prose, its fields asked for as JSON."""
    name, city, job = NAMES[i % 8], CITIES[(i * 3) % 8], JOBS[(i * 5) % 8]
    age = 21 + (i * 7) % 50
    return (
        "Extract the person's details from the text as JSON with the keys name, age, city, "
        "occupation and a one-sentence summary. Answer with the JSON only.\n\n"
        f"Text: {name} is {age} years old and lives in {city}, where {name} has worked as a "
        f"{job} for {1 + i % 9} years. In the evenings {name} volunteers at the local library."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=0, help="rows at once (0: one by one)")
    parser.add_argument("--out", default="runs/suffix-pool")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.batch < 0:
        parser.error("--requests needs >= 1 and --batch >= 0")

    target = load_model(args.target, role="target")
    ar = SpeculativeDecoder(target)
    engines = {
        "pool": SpeculativeDecoder(target, SuffixDrafter()),
        "alone": SpeculativeDecoder(target, SuffixDrafter(SuffixOptions(pool=False))),
    }
    prompts = [task(i) for i in range(args.requests)]
    rows: list[dict] = []
    jobs: dict[str, float] = {}  # each setting's whole job, tokens/s (--batch)
    if args.batch:
        expected = [ar.generate(p, args.max_new_tokens, chat=True).token_ids for p in prompts]
        rows = [{"request": i} for i in range(args.requests)]
        for name, engine in engines.items():
            start = time.perf_counter()
            results = engine.generate_batch(
                prompts, args.max_new_tokens, chat=True, max_batch=args.batch
            )
            seconds = time.perf_counter() - start
            jobs[name] = sum(r.stats.new_tokens for r in results) / seconds
            for row, result, want in zip(rows, results, expected, strict=True):
                row[name] = _record(result, want)
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        for i, prompt in enumerate(prompts):
            want = ar.generate(prompt, args.max_new_tokens, chat=True).token_ids
            row = {"request": i}
            for name, engine in engines.items():
                row[name] = _record(engine.generate(prompt, args.max_new_tokens, chat=True), want)
            rows.append(row)
            print(json.dumps(row), flush=True)
    pool = engines["pool"].drafter.pool.report()  # type: ignore[union-attr]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pool.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "jobs": jobs,
                "batch": args.batch,
                "pool": pool,
                "cpu": platform.processor(),
            },
            indent=1,
        )
    )
    quarter = max(1, args.requests // 4)
    lines = [
        "| requests | setting | acceptance | tokens/step | decode tok/s | identical |",
        "|---|---|---|---|---|---|",
    ]
    for label, part in (("first", rows[:quarter]), ("last", rows[-quarter:])):
        span = f"{part[0]['request']}-{part[-1]['request']} ({label})"
        for name in engines:
            d = sum(r[name]["drafted"] for r in part)
            a = sum(r[name]["accepted"] for r in part)
            steps = sum(r[name]["steps"] for r in part)
            new = sum(r[name]["new_tokens"] for r in part)
            rate = sum(r[name]["decode_tok_s"] or 0 for r in part) / len(part)
            same = sum(r[name]["identical"] for r in part)
            lines.append(
                f"| {span} | {name} | {a / max(d, 1):.2f} | {(new - len(part)) / max(steps, 1):.2f}"
                f" | {rate:.1f} | {same}/{len(part)} |"
            )
    for name, rate in jobs.items():
        lines.append(f"\n{name}: the whole job {rate:.1f} tok/s at {args.batch} rows")
    lines.append(f"\npool at the end: {pool}")
    (out / "pool.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _record(result, expected: list[int]) -> dict:  # type: ignore[no-untyped-def]
    """One request's numbers: against the target alone, drafted and kept, its decode rate."""
    s = result.stats
    return {
        "identical": result.token_ids == expected,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "steps": s.steps,
        "new_tokens": s.new_tokens,
        # after the first token (the prefill's): the decode alone
        "decode_tok_s": (s.new_tokens - 1) / max(s.wall_time_s - s.ttft_s, 1e-9),
    }


if __name__ == "__main__":
    raise SystemExit(main())
