"""The k policy under a server's load, in one process: B requests always in flight (a finished
one is replaced at once by the next prompt, as `serve --max-batch B` under concurrency B), for
batched decoding, fixed k and the cost policy, in alternating rounds so that the machine's drift
falls on all of them alike. Tokens/s counts every token committed in the round (rows still
running at its end included); each configuration keeps its one batch session across rounds, as
a server does. Run it alone (docs/benchmarks.md, "The cost policy under load").

    python benchmarks/policy_load.py --rows 2 --configs ar,k3,cost4 --requests 6 --rounds 3

A configuration NAME@B keeps B requests in flight instead of --rows (cost4@1,ar@8,k2@8: what
`--max-batch 1` and `--max-batch 8` servers could reach at concurrency 1 and 8, without HTTP).
"""

from __future__ import annotations

import argparse
import itertools
import re
import time
from collections import Counter

from specdecode import SpeculativeDecoder, load_model
from specdecode.bench.suites import load_suite
from specdecode.drafters import resolve_draft
from specdecode.request import GenerationRequest
from specdecode.sampling import SamplingParams

CATEGORIES = "chat,code_generation,creative_writing,question_answering,translation,math_reasoning"


def engine_for(name: str, target, draft) -> SpeculativeDecoder:
    """`ar` (no draft), `kN` (fixed k = N) or `costN` (the cost policy, k_max = N)."""
    match = re.fullmatch(r"ar|k(\d+)|cost(\d+)", name)
    if match is None:
        raise SystemExit(f"unknown configuration {name!r} (ar, kN, costN)")
    fixed, most = match.groups()
    if fixed is not None:
        return SpeculativeDecoder(target, draft, k=int(fixed))
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
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--categories", default=CATEGORIES)
    args = p.parse_args()

    target = load_model(args.target, role="target")
    draft = resolve_draft(args.draft, target)
    names = args.configs.split(",")
    rows = {n: int(n.split("@")[1]) if "@" in n else args.rows for n in names}
    sessions = {
        n: engine_for(n.split("@")[0], target, draft).batch_session(rows[n], 1024) for n in names
    }
    suite = [q.turns[0] for q in load_suite(None, args.categories.split(","), 4)]
    request = GenerationRequest(args.max_new_tokens, SamplingParams(), 0, None, [], True)
    for n in names:  # warm-up: one request each
        one_round(sessions[n], itertools.cycle(suite), request, 1, 1)
    rates: dict[str, list[float]] = {n: [] for n in names}
    ks: dict[str, Counter] = {n: Counter() for n in names}
    for rnd in range(args.rounds):
        for n in names:  # every configuration decodes the same prompts in the same order
            count = args.requests * rows[n]
            prompts = itertools.cycle(suite[rnd * count % len(suite) :] + suite)
            tokens, seconds, steps, _ = one_round(sessions[n], prompts, request, count, rows[n])
            rate = tokens / seconds
            rates[n].append(rate)
            ks[n].update(steps)
            print(f"round {rnd}  {n:8} {rate:7.2f} tok/s", flush=True)
    print(f"\n{args.target} + {args.draft}; {args.rounds} rounds of {args.requests} requests a row")
    print("| configuration | in flight | tok/s per round | mean | steps by (batch size, k) |")
    print("|---|---:|---|---:|---|")
    for n in names:
        mean = sum(rates[n]) / len(rates[n])
        per = ", ".join(f"{r:.1f}" for r in rates[n])
        hist = ", ".join(f"{b}/{k}: {c}" for (b, k), c in sorted(ks[n].items()))
        print(f"| {n} | {rows[n]} | {per} | {mean:.1f} | {hist} |")
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
