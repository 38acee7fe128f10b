"""Where the time of a speculative step goes: draft forwards, target forward, verification,
cache moves, and the Python around them.

    python lab/probes/profile_step.py --limit 4 --k 4 --max-new-tokens 64

Wraps the core's pieces with timers (the core itself reads no clock) and runs the built-in demo
prompts speculatively, greedy, chat template on. Every step's wall time is split into:
- draft forwards (`KVCache.forward` or `LeanCache.forward` on the draft model), target forward,
- verification (`verify_greedy` / `verify_sampling`), cache moves (`KVCache.rollback`),
- the rest: Python in the step, the drafter's own bookkeeping, tensor glue.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from specdecode import SpeculativeDecoder, load_model
from specdecode.core import step as chain_step
from specdecode.core import tree_decode
from specdecode.core.batch import Batch
from specdecode.core.cache import KVCache
from specdecode.demo import DEMO_PROMPTS
from specdecode.drafters import resolve_draft
from specdecode.models.lean import LeanCache

SECONDS: dict[str, float] = defaultdict(float)
IN_STEP = [False]  # prefill forwards happen outside steps and are not counted


def timed(name: Callable[..., str] | str, fn: Callable[..., Any], step: bool = False):
    """`fn` timed under `name` (or name(*args)) whenever it runs inside a step."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (IN_STEP[0] or step):
            return fn(*args, **kwargs)
        label = name(*args) if callable(name) else name
        IN_STEP[0] = True
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[label] += time.perf_counter() - start
            IN_STEP[0] = IN_STEP[0] and not step

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tree", default=None, help="a token tree instead of a chain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    target = load_model(args.target, dtype=args.dtype, device="cpu")
    draft = resolve_draft(args.draft, target, dtype=args.dtype, device="cpu")
    spec = SpeculativeDecoder(target, draft, k=args.k, tree=args.tree, time_forwards=False)
    spec.generate(DEMO_PROMPTS[0][1], 4, chat=True, temperature=0.0)  # warm-up

    target_model = target.model
    for cache in (KVCache, LeanCache):  # a batch of one runs each cache's own forward
        cache.forward = timed(
            lambda c, *a: "target forward" if c.model is target_model else "draft forwards",
            cache.forward,
        )
    for cache in (KVCache, LeanCache):
        cache.rollback = timed("cache moves", cache.rollback)
        cache.compact = timed("cache moves", cache.compact)
    for module in (chain_step, tree_decode):
        for name in dir(module):
            if name.startswith("verify_") and name != "verify_rows":  # not the forward
                setattr(module, name, timed("verification", getattr(module, name)))
    Batch.step = timed("step", Batch.step, step=True)  # decode.py's loop: a batch of one

    tokens = steps = 0
    for _, prompt in DEMO_PROMPTS[: args.limit]:
        result = spec.generate(prompt, args.max_new_tokens, chat=True, temperature=0.0)
        tokens, steps = tokens + result.stats.new_tokens, steps + result.stats.steps

    step = SECONDS.pop("step")
    shape = f"tree={args.tree}" if args.tree else f"k={args.k}"
    print(f"{args.target} / {args.draft}, {shape}, {args.dtype}: {steps} steps, {tokens} tokens")
    print(f"{'part':<28}{'ms/step':>10}{'share':>9}")
    rest = step
    for label in ("draft forwards", "target forward", "verification", "cache moves"):
        rest -= SECONDS[label]
        print(f"{label:<28}{1000 * SECONDS[label] / steps:>10.2f}{SECONDS[label] / step:>9.1%}")
    print(f"{'Python and glue (the rest)':<28}{1000 * rest / steps:>10.2f}{rest / step:>9.1%}")
    print(f"{'whole step':<28}{1000 * step / steps:>10.2f}{1:>9.1%}")


if __name__ == "__main__":
    main()
