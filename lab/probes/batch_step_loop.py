"""A batch's decode step on the lean forward: one token in each of 8 sequences (`forward_many`),
its layer loop in Python (one attention call per sequence and layer) against the native loop
(`kernels/lean_layers.cpp`: every sequence's attention in one parallel region), alternating in
one process; beside them one sequence's forward of 1 and of 8 tokens (the same rows, one cache).
Then a burst of as many short prompts (40 to 54 new tokens after 25 cached ones, as chat prompts
after a kept system prompt) prefilled one after another against together in one `forward_many`.

    python lab/probes/batch_step_loop.py --model qwen2.5-coder-1.5b-instruct:int4

Medians of `--repeats` forwards (5 for the bursts), each rolled back; the step's sequences hold
100 to 149 cached tokens.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

import specdecode.models.lean as lean
from specdecode import load_model
from specdecode.models.lean import LeanCache, target_cache


def median_ms(run: Callable[[], None], repeats: int) -> float:
    for _ in range(3):
        run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    model = load_model(args.model).model
    caches = [target_cache(model) for _ in range(args.rows)]
    one = target_cache(model)
    with torch.inference_mode():
        for i, cache in enumerate(caches):
            cache.forward(torch.randint(0, 1000, (100 + 7 * i,)), last_only=True)
        one.forward(torch.randint(0, 1000, (120,)), last_only=True)

        def step() -> None:  # one new token in every sequence, then back
            lengths = [len(c) for c in caches]
            inputs = [torch.randint(0, 1000, (1,)) for _ in caches]
            none = [None] * len(caches)
            LeanCache.forward_many(caches, inputs, positions=none, masks=none)
            for cache, length in zip(caches, lengths, strict=True):
                cache.rollback(length)

        def single(n: int) -> None:
            length = len(one)
            one.forward(torch.randint(0, 1000, (n,)))
            one.rollback(length)

        for _ in range(args.rounds):
            lean.NATIVE_LOOP = False
            python = median_ms(step, args.repeats)
            lean.NATIVE_LOOP = True
            native = median_ms(step, args.repeats)
            alone = median_ms(lambda: single(args.rows), args.repeats)
            first = median_ms(lambda: single(1), args.repeats)
            print(
                f"{args.rows} sequences x 1 token: Python loop {python:.1f} ms, native "
                f"{native:.1f} ms ({python / native:.3f}x); one sequence, {args.rows} tokens "
                f"{alone:.1f} ms, 1 token {first:.1f} ms"
            )

        prompts = [torch.randint(0, 1000, (40 + 2 * i,)) for i in range(args.rows)]
        heads = [target_cache(model) for _ in prompts]
        for cache in heads:  # a kept system prompt
            cache.forward(torch.randint(0, 1000, (25,)), last_only=True)

        def in_turn() -> None:
            for cache, prompt in zip(heads, prompts, strict=True):
                cache.forward(prompt, last_only=True)
                cache.rollback(25)

        def together() -> None:
            none = [None] * len(heads)
            LeanCache.forward_many(heads, prompts, last_only=True, positions=none, masks=none)
            for cache in heads:
                cache.rollback(25)

        for _ in range(args.rounds):
            apart, joint = median_ms(in_turn, 5), median_ms(together, 5)
            print(
                f"a burst of {len(prompts)} prompts: one after another {apart:.0f} ms, "
                f"together {joint:.0f} ms ({apart / joint:.3f}x)"
            )


if __name__ == "__main__":
    main()
