"""Forward costs measured directly: v(n), a forward over n new tokens / over 1, after a prefix.

Speculative decoding pays only when verifying k+1 tokens costs about one token's forward (the
memory-bound regime); `verify_costs` measures it on the machine at hand, the tuner uses it to
predict every k from one calibration run, and benchmarks/verify_cost.py prints it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdecode.cache import KVCache


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


@torch.inference_mode()
def forward_seconds(
    model: Any,
    sizes: Sequence[int],
    prefix: int = 128,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    cache_type: Callable[[Any], Any] = KVCache,
) -> dict[int, float]:
    """Median seconds of one forward over n new tokens after a cached `prefix`, per n in sizes.

    Random ids (the cost of a forward does not depend on which tokens it sees); the cache is
    rolled back after every forward, so each one extends the same prefix. One untimed forward
    of each size first (warm-up). `cache_type(model)` runs the forwards (a KVCache: the model's
    own forward; lean.LeanCache: the lean draft forward).
    """
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix + max(sizes),), generator=gen).to(device)
    cache = cache_type(model)
    cache.forward(ids[:prefix], last_only=True)
    seconds: dict[int, float] = {}
    for n in sizes:
        times = []
        for attempt in range(repeats + 1):
            start = clock()
            cache.forward(ids[prefix : prefix + n])
            elapsed = clock() - start
            cache.rollback(prefix)
            if attempt:  # the first is the warm-up
                times.append(elapsed)
        seconds[n] = _median(times)
    return seconds


def verify_costs(
    model: Any, max_tokens: int, prefix: int = 128, repeats: int = 5
) -> dict[int, float]:
    """v(n) for n = 1..max_tokens: forward over n new tokens / forward over 1 (v(1) = 1)."""
    seconds = forward_seconds(model, range(1, max_tokens + 1), prefix, repeats)
    return {n: t / seconds[1] for n, t in seconds.items()}
