"""The lean draft forward's time over n new tokens, with its linears called directly
(`direct_linear`, as drafters run it) or through their modules, side by side in one process.

    python lab/probes/draft_forward.py --draft qwen2.5-coder-0.5b-instruct:int4 --tokens 1,2,3,5

Two LeanCaches over the same draft model, after the same prompt; the forwards alternate
between them (a new token each time, then both roll back), so the machine's drift touches both
alike. "modules" is the lean forward as it ran before the direct calls and the fused SiLU·up:
every projection through its nn.Module, SiLU and the product in PyTorch. Both compute the same
logits bit for bit (checked first).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdecode import load_model
from specdecode.drafters import resolve_draft
from specdecode.models.lean import LeanCache, layer_projections


class _PyTorchSiluMul:
    """The fused operations, except SiLU·up, which runs in PyTorch operations."""

    def __init__(self, fused: object) -> None:
        self._fused = fused

    def __getattr__(self, name: str) -> object:
        return getattr(self._fused, name)

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


def through_modules(cache: LeanCache) -> LeanCache:
    """`cache` made to call every linear through its module and SiLU·up through PyTorch."""
    cache._linears = [layer_projections(layer) for layer in cache.layers]
    cache._lm_head = cache.model.lm_head
    if cache._fused is not None:
        cache._fused = _PyTorchSiluMul(cache._fused)
    cache._native = None  # the layer loop in Python, which calls the above
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="for the vocab")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct:int4")
    parser.add_argument("--tokens", default="1,2,3,5", help="new tokens per forward")
    parser.add_argument("--prompt", type=int, default=200, help="cached tokens before")
    parser.add_argument("--repeats", type=int, default=150, help="forwards per side and size")
    args = parser.parse_args()
    sizes = [int(n) for n in args.tokens.split(",")]
    target = load_model(args.target, dtype="bfloat16", device="cpu")
    draft = resolve_draft(args.draft, target, dtype="bfloat16", device="cpu")
    del target
    sides = {"direct": LeanCache(draft.model), "modules": through_modules(LeanCache(draft.model))}
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 30000, (args.prompt,), generator=gen)
    with torch.inference_mode():
        logits = [cache.forward(prompt) for cache in sides.values()]
        if not torch.equal(*logits):
            raise SystemExit("the two forwards disagree: not the same computation")
        print(f"draft {args.draft}, {args.prompt} cached tokens, median of {args.repeats}\n")
        print("| new tokens | direct ms | modules ms | modules / direct |")
        print("|---|---|---|---|")
        for n in sizes:
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.repeats):
                ids = torch.randint(0, 30000, (n,), generator=gen)
                for name, cache in sides.items():
                    start = time.perf_counter()
                    cache.forward(ids)
                    seconds[name].append(time.perf_counter() - start)
                    cache.rollback(args.prompt)
            direct, modules = (statistics.median(seconds[name]) for name in sides)
            print(
                f"| {n} | {direct * 1e3:.1f} | {modules * 1e3:.1f} | {modules / direct:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
