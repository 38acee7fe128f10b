"""How often the hybrid joins the model's chain and the suffix tree, and what the joins add.

    python lab/probes/hybrid_join.py --categories summarization,code_editing,extraction_rag \
        --per-category 2 --prior-join 1.0

Needs the code of the joined-tree commit (2f72e2d; reverted after measuring). One engine with
`MODEL+suffix` and one with `MODEL+suffix:join=off` over the bfloat16 target, greedy chat
prompts in turn, the suffix pool emptied before each generation (as `bench` does). Prints each
prompt's decode rate and steps per way for both, every joined step's estimates (n, rates, the
suffix nodes' estimated extra tokens, the join factor) and what it kept, and at the end the
join factor's totals: tokens the suffix nodes added against those estimated.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import specdecode.drafters.hybrid as hybrid_module
from specdecode import SpeculativeDecoder, load_model
from specdecode.drafters.factory import resolve_draft
from specdecode.drafters.hybrid import HybridDrafter


def instrument(log: list[dict]) -> None:
    """Wrap the hybrid's choice and its outcome to append one record per step to `log`."""
    propose, observe = HybridDrafter.propose_tree, HybridDrafter.observe_path

    def propose_tree(self, context, max_depth):  # type: ignore[no-untyped-def]
        proposal = self.suffix.suggest(context, max_depth)
        n, suffix_rate = proposal.best_size(self.costs)
        k, model_rate = self.model_rate(min(self.k_max, max_depth))
        joined = self.joined_rate(proposal, k) if k and proposal.gains else (0, 0.0, 0.0)
        factor = self.join.value()
        tree = propose(self, context, max_depth)
        log.append(
            {
                "way": self._used[0] if self._used else "none",
                "suffix_n": n,
                "suffix_rate": round(suffix_rate, 3),
                "model_k": k,
                "model_rate": round(model_rate, 3),
                "joined_n": joined[0],
                "joined_rate": round(joined[1], 3),
                "extra": round(joined[2], 2),
                "factor": round(factor, 2),
                "nodes": len(tree),
            }
        )
        return tree

    def observe_path(self, path):  # type: ignore[no-untyped-def]
        log[-1]["kept"] = 1 + len(path)
        return observe(self, path)

    HybridDrafter.propose_tree = propose_tree  # type: ignore[method-assign]
    HybridDrafter.observe_path = observe_path  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--prompts", default="lab/runs/hybrid-heldout-amx/prompts.jsonl")
    parser.add_argument("--categories", default="summarization,code_editing,extraction_rag")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--prior-join", type=float, default=None, help="PRIOR_JOIN to run with")
    args = parser.parse_args()
    if args.prior_join is not None:
        hybrid_module.PRIOR_JOIN = args.prior_join
    with open(args.prompts) as lines:
        every = [json.loads(line) for line in lines]
    prompts = [
        p
        for c in args.categories.split(",")
        for p in [q for q in every if q["category"] == c][: args.per_category]
    ]
    target = load_model(args.target)
    log: list[dict] = []
    instrument(log)
    engines = {
        way: SpeculativeDecoder(target, resolve_draft(f"{args.draft}+{spec}", target), k=4)
        for way, spec in (("join", "suffix"), ("off", "suffix:join=off"))
    }
    for p in prompts:
        for way, engine in engines.items():
            start = len(log)
            engine.drafter.suffix.pool.clear()
            stats = engine.generate(p["prompt"], max_new_tokens=64, chat=True).stats
            rate = (stats.new_tokens - 1) / max(stats.wall_time_s - stats.ttft_s, 1e-9)
            ways: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # steps, tokens kept
            for step in log[start:]:
                ways[step["way"]][0] += 1
                ways[step["way"]][1] += step.get("kept", 1)
            print(f"{p['id']} {way}: {rate:.1f} tok/s, {len(log) - start} steps, {dict(ways)}")
            for step in log[start:]:
                if step["way"] == "joined":
                    print("    ", json.dumps(step))
    join = engines["join"].drafter
    print("join factor:", join.join.__dict__, "chosen:", join.chosen)
    print("join=off chosen:", engines["off"].drafter.chosen)


if __name__ == "__main__":
    main()
