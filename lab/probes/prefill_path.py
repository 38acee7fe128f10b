"""A prompt's prefill on the lean forward's fused operations against its PyTorch path, side by
side in one process (the reason prefill chunks take the fused path within PREFILL_CHUNK keys).

    python lab/probes/prefill_path.py --model qwen2.5-coder-1.5b-instruct --tokens 40,128,300,512

Two LeanCaches over the same model; for each prompt length, rounds alternate between them: the
PyTorch path (the fused operations off for this forward) and the fused one (allowed for every
forward). Prints the best of the rounds in ms per prefill, and whether the last logits agree
bit for bit (they need not: the two paths round differently, which is why only the fused one's
keys and values can be handed to the next prompt, docs/architecture.md "Prefix reuse").
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode import load_model
from specdecode.models.lean import LeanCache, target_residual


def prefill_ms(
    cache: LeanCache, ids: torch.Tensor, fused_tokens: int
) -> tuple[float, torch.Tensor]:
    cache.fused_tokens = fused_tokens
    cache.rollback(0)
    start = time.perf_counter()
    logits = cache.forward(ids, last_only=True)
    return (time.perf_counter() - start) * 1e3, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--tokens", default="40,128,300,512", help="prompt lengths")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = load_model(args.model, dtype="bfloat16", device="cpu").model
    residual = target_residual(model)
    plain, fused = (LeanCache(model, residual=residual) for _ in range(2))
    print("| tokens | PyTorch path ms | fused ms | fused / PyTorch | same last logits |")
    print("|---|---|---|---|---|")
    for n in [int(t) for t in args.tokens.split(",")]:
        ids = torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(n))
        times: dict[str, list[float]] = {"plain": [], "fused": []}
        for _ in range(args.rounds):
            ms, want = _plain(plain, ids)
            times["plain"].append(ms)
            ms, got = prefill_ms(fused, ids, 1 << 20)  # every chunk fused, past 512 keys too
            times["fused"].append(ms)
        a, b = min(times["plain"]), min(times["fused"])
        print(f"| {n} | {a:.0f} | {b:.0f} | {b / a:.2f} | {torch.equal(want, got)} |")


def _plain(cache: LeanCache, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The prefill with the fused operations off (the cache's extension hidden for it)."""
    fused, cache._fused = cache._fused, None
    try:
        return prefill_ms(cache, ids, 0)
    finally:
        cache._fused = fused


if __name__ == "__main__":
    main()
