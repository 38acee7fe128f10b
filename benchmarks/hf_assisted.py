"""Our speculative decoding beside Hugging Face's assisted generation, same models, same prompts.

    python -m benchmarks.hf_assisted --limit 4 --max-new-tokens 48

Methods, interleaved per prompt after a warm-up, all greedy, chat template applied, new tokens
counted from ids: `hf-ar` (HF generate alone), `hf-assisted` (its default schedule),
`hf-assisted-k` (constant k drafts), `ar` (our target alone), `spec` (ours, k drafts).
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode import SpeculativeDecoder, load_model
from specdecode.demo import DEMO_PROMPTS


def hf_generate(model, ids: list[int], max_new: int, assistant=None) -> tuple[list[int], float]:
    inputs = torch.tensor([ids])
    start = time.perf_counter()
    out = model.generate(
        inputs,
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new,
        do_sample=False,
        assistant_model=assistant,
    )
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    target = load_model(args.target, dtype=args.dtype, device="cpu")
    draft = load_model(args.draft, dtype=args.dtype, device="cpu")
    ar, spec = (
        SpeculativeDecoder(target),
        SpeculativeDecoder(target, draft, k=args.k, k_policy="fixed"),
    )
    default_schedule = dict(draft.model.generation_config.to_dict())
    constant = {
        "num_assistant_tokens_schedule": "constant",
        "num_assistant_tokens": args.k,
        "assistant_confidence_threshold": 0.0,
    }

    def set_schedule(values: dict) -> None:
        for key in constant:
            setattr(draft.model.generation_config, key, values.get(key))

    def run(method: str, ids: list[int]) -> tuple[list[int], float]:
        if method == "ar":
            r = ar.generate(ids, args.max_new_tokens, temperature=0.0, eos_token_ids=[])
            return r.token_ids, r.stats.wall_time_s
        if method == "spec":
            r = spec.generate(ids, args.max_new_tokens, temperature=0.0, eos_token_ids=[])
            return r.token_ids, r.stats.wall_time_s
        if method == "hf-ar":
            return hf_generate(target.model, ids, args.max_new_tokens)
        set_schedule(constant if method == "hf-assisted-k" else default_schedule)
        return hf_generate(target.model, ids, args.max_new_tokens, assistant=draft.model)

    # every method ignores EOS so all produce exactly max_new_tokens from the same prompt
    target.model.generation_config.eos_token_id = None
    methods = ["ar", "spec", "hf-ar", "hf-assisted", "hf-assisted-k"]
    prompts = DEMO_PROMPTS[: args.limit]
    warm = spec.encode_prompt(prompts[0][1], chat=True)
    for method in methods:
        run(method, warm[:16])
    rates: dict[str, list[float]] = {m: [] for m in methods}
    print(f"{args.target} / {args.draft}, k={args.k}, {args.dtype}, {args.max_new_tokens} tokens")
    print("| prompt kind | " + " | ".join(f"{m} tok/s" for m in methods) + " |")
    print("|---" * (len(methods) + 1) + "|")
    for kind, prompt in prompts:
        ids = spec.encode_prompt(prompt, chat=True)
        cells = []
        for method in methods:
            tokens, seconds = run(method, ids)
            rates[method].append(len(tokens) / seconds)
            cells.append(f"{len(tokens) / seconds:.2f}")
        print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)

    def geomean(xs: list[float]) -> float:
        return float(torch.tensor(xs).log().mean().exp())

    print("\nspeedup over the target alone (geometric mean of per-prompt ratios):")
    for method, base in (("spec", "ar"), ("hf-assisted", "hf-ar"), ("hf-assisted-k", "hf-ar")):
        ratios = [a / b for a, b in zip(rates[method], rates[base], strict=True)]
        print(f"  {method} vs {base}: {geomean(ratios):.2f}x")
    ratios = [a / b for a, b in zip(rates["spec"], rates["hf-assisted-k"], strict=True)]
    print(f"  spec vs hf-assisted-k tokens/s: {geomean(ratios):.2f}x")


if __name__ == "__main__":
    main()
