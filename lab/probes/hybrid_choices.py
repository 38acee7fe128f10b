"""What the hybrid (`MODEL+suffix`) chose at each step, what it expected, what the target kept.

    python lab/probes/hybrid_choices.py --prompts lab/runs/hybrid-heldout-amx/prompts.jsonl \
        --category code_generation

One engine, greedy, chat prompts of one category in turn (rows one after another, as the bench
runs them). Each step's choice (suffix tree, model chain or nothing) is logged with the tokens it
promised (1 + its nodes' or positions' expected acceptance) and the tokens the step committed;
per choice the totals say whether the promises were kept, and per prompt how the steps split.
The model draft alone runs the same prompts after, for its steps and tokens per second.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from specdecode import SpeculativeDecoder, load_model
from specdecode.core.policies import verify_cost
from specdecode.core.tree import TokenTree
from specdecode.drafters.factory import resolve_draft
from specdecode.drafters.hybrid import HybridDrafter


def instrument(log: list[dict]) -> None:
    """Wrap HybridDrafter's choice and its outcome to append one record per step to `log`."""
    choose, observe = HybridDrafter._choose, HybridDrafter.observe_path

    def _choose(self, context, max_depth, rows):  # type: ignore[no-untyped-def]
        proposal = self.suffix.suggest(context, max_depth)
        n, suffix_rate = proposal.best_size(self.costs, rows)
        k, model_rate = self.model_rate(min(self.k_max, max_depth), rows)
        choice = choose(self, context, max_depth, rows)  # a tree, or the model chain's k
        way = self._used[0] if self._used else "none"
        record = {
            "way": way,
            "suffix_n": n,
            "suffix_rate": round(suffix_rate, 3),
            "suffix_promise": 1 + sum(proposal.gains[:n]),
            "model_k": k,
            "model_rate": round(model_rate, 3),
            "plain": round(1.0 / verify_cost(self.costs, 1), 3),
            "c": round(self._draft_cost(), 3),
            "nodes": len(choice) if isinstance(choice, TokenTree) else choice,
        }
        if way == "model":
            emitted, reach = 1.0, 1.0
            for a in self.row_estimate()[:k]:
                reach *= a
                emitted += reach
            record["model_promise"] = emitted
        log.append(record)
        return choice

    def observe_path(self, path):  # type: ignore[no-untyped-def]
        if log:
            log[-1]["kept"] = 1 + len(path)
        return observe(self, path)

    HybridDrafter._choose = _choose  # type: ignore[method-assign]
    HybridDrafter.observe_path = observe_path  # type: ignore[method-assign]


def decode_rate(stats) -> float:  # type: ignore[no-untyped-def]
    """Tokens per second after the first token (prefill excluded)."""
    return (stats.new_tokens - 1) / max(stats.wall_time_s - stats.ttft_s, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--prompts", default="lab/runs/hybrid-heldout-amx/prompts.jsonl")
    parser.add_argument("--category", default="code_generation")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    with open(args.prompts) as lines:
        prompts = [json.loads(line) for line in lines]
    prompts = [p for p in prompts if p["category"] == args.category]
    target = load_model(args.target)
    log: list[dict] = []
    instrument(log)
    hybrid = SpeculativeDecoder(target, resolve_draft(f"{args.draft}+suffix", target), k=args.k)
    model = SpeculativeDecoder(target, resolve_draft(args.draft, target), k=args.k)
    for p in prompts:
        start = len(log)
        res = hybrid.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=True)
        alone = model.generate(p["prompt"], max_new_tokens=args.max_new_tokens, chat=True)
        steps = log[start:]
        ways = defaultdict(lambda: [0, 0.0, 0])  # steps, promised, kept
        for s in steps:
            w = ways[s["way"]]
            w[0] += 1
            w[1] += s.get("suffix_promise" if s["way"] == "suffix" else "model_promise", 1.0)
            w[2] += s.get("kept", 1)
        same = res.token_ids == alone.token_ids
        print(
            f"{p['id']}: hybrid {decode_rate(res.stats):.1f} tok/s in "
            f"{len(steps)} steps, model alone {decode_rate(alone.stats):.1f} tok/s "
            f"({alone.stats.steps} steps, α {alone.stats.acceptance_rate:.2f}); identical {same}"
        )
        for way, (n, promised, kept) in sorted(ways.items()):
            print(f"    {way:6s} {n:3d} steps, promised {promised:6.1f} tokens, kept {kept:4d}")
        for s in steps:
            print("      ", json.dumps(s))


if __name__ == "__main__":
    main()
