"""The real pair in bfloat16: `generate_batch` of 8 prompts against each prompt decoded alone
(greedy), a chain and a tree (lab/benchmarks.md, "Continuous batching on the real pair").

    python lab/probes/batch_identity.py
"""

from __future__ import annotations

import json
from pathlib import Path

from specdecode import SpeculativeDecoder, load_model
from specdecode.drafters import resolve_draft

SUITE = Path(__file__).resolve().parents[1] / "src/specdecode/data/prompts/suite.jsonl"
CATEGORIES = ("chat", "code_generation", "translation", "math_reasoning")


def main() -> None:
    target = load_model("qwen2.5-coder-1.5b-instruct")
    draft = resolve_draft("qwen2.5-coder-0.5b-instruct:int4", target)
    n_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    print(f"target weights {n_bytes / 2**30:.2f} GiB")
    rows = [json.loads(line) for line in SUITE.read_text().splitlines()]
    chosen = [r for r in rows if r["category"] in CATEGORIES][::4][:8]
    prompts = [r["prompt"] if isinstance(r.get("prompt"), str) else r["turns"][0] for r in chosen]
    for options in ({"k": 3}, {"tree": "dynamic:5,6,2,0.3"}):
        engine = SpeculativeDecoder(target, draft, **options)
        batch = engine.generate_batch(prompts, 48, chat=True, temperature=0.0)
        alone = [engine.generate(p, 48, chat=True, temperature=0.0) for p in prompts]
        same = sum(b.token_ids == a.token_ids for b, a in zip(batch, alone, strict=True))
        print(options, f"{same}/{len(prompts)} identical")


if __name__ == "__main__":
    main()
