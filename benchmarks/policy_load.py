"""The k policy under a server's load, in one process: B requests always in flight (a finished
one is replaced at once by the next prompt, as `serve --max-batch B` under concurrency B), for
batched decoding, fixed k and the cost policy, in alternating rounds so that the machine's drift
falls on all of them alike. Tokens/s counts every token committed in the round (rows still
running at its end included); each configuration keeps its one batch session across rounds, as
a server does. Run it alone (lab/benchmarks.md, "Where batching stops on 2 cores").

    python -m benchmarks.policy_load --rows 2 --configs ar,k3,cost4 --requests 6 --rounds 3

A configuration NAME@B keeps B requests in flight instead of --rows (cost4@1,ar@8,k2@8: what
`--max-batch 1` and `--max-batch 8` servers could reach at concurrency 1 and 8, without HTTP).
As a `--max-batch 8` server measured at concurrency 1 and then 2 (its policy learns one row
first, in a session of 8 rows):

    python -m benchmarks.policy_load --rows 2 --store-rows 8 --first-level 20 \
        --configs k3,cost4 --requests 6 --rounds 4

"target ms" is the mean time of the target's batched forward (its verified rows beside it).
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from collections import Counter

from specdecode import SpeculativeDecoder, load_model
from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams
from specdecode.data.suites import load_suite
from specdecode.drafters import resolve_draft

CATEGORIES = "chat,code_generation,creative_writing,question_answering,translation,math_reasoning"


def engine_for(name: str, target, draft) -> SpeculativeDecoder:
    """`ar` (no draft), `kN` (fixed k = N) or `costN` (the cost policy, k_max = N)."""
    match = re.fullmatch(r"ar|k(\d+)|cost(\d+)", name)
    if match is None:
        raise SystemExit(f"unknown configuration {name!r} (ar, kN, costN)")
    fixed, most = match.groups()
    if fixed is not None:
        return SpeculativeDecoder(target, draft, k=int(fixed), k_policy="fixed")
    if most is not None:
        return SpeculativeDecoder(target, draft, k=int(most), k_policy="cost")
    return SpeculativeDecoder(target, None)


def one_round(session, prompts, request: GenerationRequest, requests: int, rows: int):
    """Keep `rows` requests in flight until `requests` have finished: (tokens committed, seconds,
    Counter of (batch size, k) over the round's steps, every generation it started). Those still
    running at the end are cancelled: the next round starts with a fresh set."""
    started, running, finished, steps = [], [], 0, Counter()
    tokens = 0
    start = time.perf_counter()
    while finished < requests:
        while len(running) < rows:
            running.append(session.add(next(prompts), request, begin_draft=False))
            started.append(running[-1])
            tokens += len(running[-1].new_ids)  # the prefill's first token
        size = len(session.generations)
        for g in session.step():
            tokens += len(g.new_ids)
        steps[(size, session.batch.last_k)] += 1
        finished += sum(g.finished for g in running)
        running = [g for g in running if not g.finished]
    seconds = time.perf_counter() - start
    for g in running:
        session.cancel(g)
    return tokens, seconds, steps, started


def target_forwards(meter) -> tuple[float, int, int]:
    """(seconds, calls, rows) of the target's batched forwards so far (prefills apart)."""
    return (
        meter.seconds.get("target", 0.0),
        meter.calls.get("target", 0),
        meter.tokens.get("target", 0),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--configs", default="ar,k3,cost4")
    p.add_argument(
        "--requests", type=int, default=6, help="finished requests per round, per row in flight"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--store-rows", type=int, help="rows of each session (default: in flight)")
    p.add_argument(
        "--first-level", type=int, default=0, help="requests one at a time before the rounds"
    )
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--categories", default=CATEGORIES)
    args = p.parse_args()

    target = load_model(args.target, role="target")
    draft = resolve_draft(args.draft, target)
    names = args.configs.split(",")
    rows = {n: int(n.split("@")[1]) if "@" in n else args.rows for n in names}
    sessions = {
        n: engine_for(n.split("@")[0], target, draft).batch_session(
            max(rows[n], args.store_rows or 0), 1024
        )
        for n in names
    }
    suite = [q.turns[0] for q in load_suite(None, args.categories.split(","), 4)]
    request = GenerationRequest(args.max_new_tokens, SamplingParams(), 0, None, [], True)
    for n in names:  # warm-up: one request each, or a first level of one at a time
        first = one_round(sessions[n], itertools.cycle(suite), request, args.first_level or 1, 1)
        if args.first_level:
            print(f"first level  {n:8} {first[0] / first[1]:7.2f} tok/s", flush=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    forwards: dict[str, list[float]] = {n: [0.0, 0, 0] for n in names}  # seconds, calls, rows
    ks: dict[str, Counter] = {n: Counter() for n in names}
    for rnd in range(args.rounds):
        for n in names:  # every configuration decodes the same prompts in the same order
            count = args.requests * rows[n]
            prompts = itertools.cycle(suite[rnd * count % len(suite) :] + suite)
            meter = sessions[n].batch.meter
            before = target_forwards(meter)
            tokens, seconds, steps, _ = one_round(sessions[n], prompts, request, count, rows[n])
            forwards[n] = [
                a + b - c
                for a, b, c in zip(forwards[n], target_forwards(meter), before, strict=True)
            ]
            rate = tokens / seconds
            rates[n].append(rate)
            ks[n].update(steps)
            print(f"round {rnd}  {n:8} {rate:7.2f} tok/s", flush=True)
    print(f"\n{args.target} + {args.draft}; {args.rounds} rounds of {args.requests} requests a row")
    print(
        "| configuration | in flight | tok/s per round | mean | target ms (rows) |"
        " steps by (batch size, k) |"
    )
    print("|---|---:|---|---:|---:|---|")
    for n in names:
        mean = sum(rates[n]) / len(rates[n])
        per = ", ".join(f"{r:.1f}" for r in rates[n])
        spent, calls, verified = forwards[n]
        forward = f"{1e3 * spent / calls:.1f} ({verified / calls:.1f})" if calls else "-"
        hist = ", ".join(f"{b}/{k}: {c}" for (b, k), c in sorted(ks[n].items()))
        print(f"| {n} | {rows[n]} | {per} | {mean:.1f} | {forward} | {hist} |")
    for n in names:
        policy = sessions[n].batch.policy
        if not hasattr(policy, "rates"):
            continue
        print(f"\n{n}: acceptance {[round(a, 2) for a in policy.acceptance()]}")
        print("  T(n) ms", {i: round(m.value * 1e3, 1) for i, m in sorted(policy._target.items())})
        print("  D(B) ms", {i: round(m.value * 1e3, 1) for i, m in sorted(policy._draft.items())})
        for b in range(1, rows[n] + 1):
            print(f"  rows {b}: rates", [round(r, 2) for r in policy.rates(None, b)])


if __name__ == "__main__":
    main()
