"""The hybrid (`MODEL+suffix`) against its model draft alone, in one batch of rows.

    python lab/probes/hybrid_batch.py --rows 8 --rounds 2

`generate_batch` over the first `--rows` prompts of the held-out file (greedy, chat template,
96 new tokens, the cost policy, k up to 4), the model draft and the hybrid alternating A B B A
in one process, on the `:int4` pair. Per run: wall seconds, tokens per second, steps, tokens per
step, the seconds the rows' shares of the target's forwards add to (a row's meter carries no
share of the batch's draft forwards), and the hybrid's choices (suffix tree, model chain,
nothing). Where a server at 8 clients serves the hybrid slower than the model draft, this says
whether a batch of the same rows does too.
"""

from __future__ import annotations

import argparse
import json
import time

from specdecode import SpeculativeDecoder, load_model
from specdecode.drafters.factory import resolve_draft

TARGET = "qwen2.5-coder-1.5b-instruct:int4"
DRAFT = "qwen2.5-coder-0.5b-instruct:int4"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default="lab/runs/hybrid-heldout-amx/prompts.jsonl")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    with open(args.prompts, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    # one prompt per category first, so that 8 rows span the kinds of prompt
    by_category: dict[str, list[str]] = {}
    for record in records:
        text = record["prompt"] if "prompt" in record else record["turns"][0]  # a chat: its first
        by_category.setdefault(record["category"], []).append(text)
    prompts = [p for group in zip(*by_category.values(), strict=False) for p in group]
    prompts = prompts[: args.rows]
    target = load_model(TARGET)
    engines = {}
    for name, spec in (("model", DRAFT), ("hybrid", DRAFT + "+suffix")):
        drafter = resolve_draft(spec, target)
        engines[name] = SpeculativeDecoder(target, drafter, k=4, k_policy="cost")
    engines["model"].generate_batch(prompts[:2], max_new_tokens=8, chat=True)  # warm up
    engines["hybrid"].generate_batch(prompts[:2], max_new_tokens=8, chat=True)
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = ("model", "hybrid") if r % 2 == 0 else ("hybrid", "model")
        for name in order:
            engine = engines[name]
            chosen_before = dict(getattr(engine.drafter, "chosen", {}))
            start = time.perf_counter()
            results = engine.generate_batch(prompts, max_new_tokens=args.max_new_tokens, chat=True)
            wall = time.perf_counter() - start
            tokens = sum(len(res.token_ids) for res in results)
            steps = sum(res.stats.steps for res in results)
            emitted = sum(res.stats.emitted for res in results)
            meters = [res.stats.meter for res in results]
            target_s = sum(m.seconds.get("target", 0.0) for m in meters)
            chosen = {
                way: n - chosen_before.get(way, 0)
                for way, n in getattr(engine.drafter, "chosen", {}).items()
            }
            outputs.setdefault(name, [res.token_ids for res in results])
            print(
                f"{name:6s} round {r + 1}: {wall:6.2f} s, {tokens / wall:6.1f} tok/s, "
                f"{steps} row-steps, {emitted / max(steps, 1):.2f} tokens a row-step, "
                f"target shares {target_s:.2f} s, chosen {chosen or '-'}",
                flush=True,
            )
    same = sum(a == b for a, b in zip(outputs["model"], outputs["hybrid"], strict=True))
    print(f"identical outputs, model draft vs hybrid: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
