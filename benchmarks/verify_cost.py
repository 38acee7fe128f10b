"""Measure v(n): the target's forward time over n new tokens / over 1 token, after a cached prefix.

    python benchmarks/verify_cost.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16

Speculative decoding pays only when verifying k+1 tokens costs about as much as one token; this
prints the ratio on the machine at hand (median of several repeats, after a warm-up).
"""

from __future__ import annotations

import argparse
import platform

import torch

from specdecode.bench.costs import forward_seconds
from specdecode.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="1,2,3,5,9")
    parser.add_argument("--prefix", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = load_model(args.model, dtype=args.dtype, device="cpu").model
    sizes = sorted({1, *(int(n) for n in args.tokens.split(","))})
    seconds = forward_seconds(model, sizes, prefix=args.prefix, repeats=args.repeats)
    print(
        f"{args.model}, {args.dtype}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print("| new tokens | forward ms | v = ms / one-token ms |")
    print("|---|---|---|")
    for n in sizes:
        print(f"| {n} | {seconds[n] * 1000:.0f} | {seconds[n] / seconds[1]:.2f} |")


if __name__ == "__main__":
    main()
