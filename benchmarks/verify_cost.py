"""Measure v(n): the target's forward time over n new tokens / over 1 token, after a cached prefix.

    python benchmarks/verify_cost.py --model qwen2.5-coder-1.5b-instruct --dtype bfloat16

Speculative decoding pays only when verifying k+1 tokens costs about as much as one token; this
prints the ratio on the machine at hand (minimum of several repeats, after a warm-up).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from specdecode.cache import KVCache
from specdecode.models.loading import load_model


def forward_ms(cache: KVCache, ids: torch.Tensor, prefix: int, n: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cache.forward(ids[prefix : prefix + n])
        times.append(time.perf_counter() - start)
        cache.rollback(prefix)
    return min(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", default="1,2,3,5,9")
    parser.add_argument("--prefix", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    model = load_model(args.model, dtype=args.dtype, device="cpu").model
    sizes = [int(n) for n in args.tokens.split(",")]
    ids = torch.randint(
        0, 1000, (args.prefix + max(sizes),), generator=torch.Generator().manual_seed(0)
    )
    cache = KVCache(model)
    with torch.inference_mode():
        cache.forward(ids[: args.prefix], last_only=True)
        forward_ms(cache, ids, args.prefix, 1, 1)  # warm-up
        base = forward_ms(cache, ids, args.prefix, 1, args.repeats)
        print(
            f"{args.model}, {args.dtype}, {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}"
        )
        print("| new tokens | forward ms | v = ms / one-token ms |")
        print("|---|---|---|")
        for n in sizes:
            ms = base if n == 1 else forward_ms(cache, ids, args.prefix, n, args.repeats)
            print(f"| {n} | {ms:.0f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
