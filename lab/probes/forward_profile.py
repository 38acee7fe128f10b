"""Where a one-token forward on the lean forward spends its time, call by call.

    python lab/probes/forward_profile.py --model qwen2.5-coder-1.5b-instruct:int4 --role target
    python lab/probes/forward_profile.py --model qwen2.5-coder-0.5b-instruct:int4 --role draft

A LeanCache over the model (a target's with its float32 residual stream where quantized), a
prompt of `--prompt` random tokens, then `--repeats` one-token forwards, each rolled back. Every
kernel call of the forward (the seven projections per layer, the output layer, and the fused
operations: add + RMSNorm, rotary embedding + attention, SiLU * up) is wrapped with a timer;
prints the mean ms per forward of each kind and what is left outside them (Python, embedding,
rotary tables, the cache's bookkeeping). The layer loop runs in Python here (its calls are
timed one by one); the timers add a little to every call. Interleaved with it, the same
forward as decoding runs it (the loop in C++, `kernels/lean_layers.cpp`), untimed.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from specdecode import load_model
from specdecode.models.lean import LeanCache, target_residual

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def timed(call: Callable[..., Any], name: str, spent: dict[str, float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = call(*args, **kwargs)
        spent[name] += time.perf_counter() - start
        return out

    return wrapper


class _TimedOps:
    """The cache's fused-operations extension with every call timed."""

    def __init__(self, ops: Any, spent: dict[str, float]) -> None:
        self._ops, self._spent = ops, spent

    def __getattr__(self, name: str) -> Any:
        return timed(getattr(self._ops, name), name, self._spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--role", choices=("target", "draft"), default="target")
    parser.add_argument("--prompt", type=int, default=200, help="cached tokens before")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument(
        "--tokens", type=int, default=1, help="new tokens per forward (a verification, a prefill)"
    )
    args = parser.parse_args()
    model = load_model(args.model, role=args.role).model
    residual = target_residual(model) if args.role == "target" else None
    cache = LeanCache(model, residual=residual)
    if cache._fused is None:
        raise SystemExit(
            "the fused operations do not run for this model (bfloat16 on the CPU kernels)"
        )
    spent: dict[str, float] = defaultdict(float)
    cache._linears = [
        tuple(timed(f, name, spent) for f, name in zip(calls, PROJECTIONS, strict=True))
        for calls in cache._linears
    ]
    if cache._prefill is not None:  # a prefill past VERIFY_TOKENS rows on another product
        cache._prefill = [
            tuple(timed(f, name, spent) for f, name in zip(calls, PROJECTIONS, strict=True))
            for calls in cache._prefill
        ]
    cache._lm_head = timed(cache._lm_head, "lm_head", spent)
    cache._fused = _TimedOps(cache._fused, spent)
    cache._native = None  # the layer loop in Python, which calls the timed ones
    native = LeanCache(model, residual=residual)  # the layer loop in C++, untimed, for comparison
    with torch.inference_mode():
        prompt = torch.randint(0, 1000, (args.prompt,))
        cache.forward(prompt, last_only=True)
        native.forward(prompt, last_only=True)
        past = len(cache)
        new = torch.randint(0, 1000, (args.tokens,))

        def one(on: LeanCache) -> float:
            start = time.perf_counter()
            on.forward(new, last_only=True)
            on.rollback(past)
            return time.perf_counter() - start

        for _ in range(10):  # warm-up
            one(cache), one(native)
        spent.clear()
        times = [(one(cache), one(native)) for _ in range(args.repeats)]  # interleaved
        total = sum(timed for timed, _ in times) / args.repeats * 1e3
        untimed = sum(fast for _, fast in times) / args.repeats * 1e3
    print(
        f"{args.model} ({args.role}): {total:.2f} ms a forward of {args.tokens} tokens, "
        f"{args.prompt} cached"
    )
    print(f"  (the same forward with the layer loop in C++ and no timers: {untimed:.2f} ms)")
    inside = 0.0
    for name, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        ms = seconds / args.repeats * 1e3
        inside += ms
        print(f"  {name:18s} {ms:7.3f} ms")
    print(f"  {'outside them':18s} {total - inside:7.3f} ms")


if __name__ == "__main__":
    main()
