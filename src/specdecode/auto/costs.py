"""Forward costs measured directly: v(n), a forward over n new tokens / over 1, after a prefix.

Speculative decoding pays only when verifying k+1 tokens costs about one token's forward (the
memory-bound regime); `verify_costs` measures it on the machine at hand, the tuner uses it to
predict every k from one calibration run, and `specdecode calibrate` shows it.
`expected_chain_step` is the model both the tuner and the calibration (calibrate.py) predict a
chain with.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdecode.core.cache import KVCache


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
    done: Callable[[int], None] | None = None,
) -> dict[int, float]:
    """Median seconds of one forward over n new tokens after a cached `prefix`, per n in sizes.

    Random ids (the cost of a forward does not depend on which tokens it sees); the cache is
    rolled back after every forward, so each one extends the same prefix. One untimed round over
    every size first (warm-up), then `repeats` timed rounds, each over every size in turn: a
    machine that speeds up or slows down while it measures (a VM whose first seconds run slower:
    docs/results.md) shifts every size alike instead of the first
    ones measured. `cache_type(model)` runs the forwards (a KVCache: the model's own
    forward; lean.LeanCache: the lean forward; lean.target_cache: the forward the target decodes
    with). `done(n)` is called after each forward (a progress bar: (repeats + 1) * len(sizes)).
    """
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (prefix + max(sizes),), generator=gen).to(device)
    cache = cache_type(model)
    cache.forward(ids[:prefix], last_only=True)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for attempt in range(repeats + 1):
        for n in sizes:
            start = clock()
            cache.forward(ids[prefix : prefix + n])
            elapsed = clock() - start
            cache.rollback(prefix)
            if attempt:  # the first round is the warm-up
                times[n].append(elapsed)
            if done is not None:
                done(n)
    return {n: _median(t) for n, t in times.items()}


def verify_costs(
    model: Any, max_tokens: int, prefix: int = 128, repeats: int = 5
) -> dict[int, float]:
    """v(n) for n = 1..max_tokens: forward over n new tokens / forward over 1 (v(1) = 1)."""
    seconds = forward_seconds(model, range(1, max_tokens + 1), prefix, repeats)
    return {n: t / seconds[1] for n, t in seconds.items()}


def expected_chain_step(
    profile: dict[str, list[float]],
    k: int,
    v: dict[int, float],
    t_draft: float,
    t_1: float,
    o_step: float,
) -> tuple[float, float]:
    """(expected tokens emitted, expected seconds) of one chain step drafting at most k tokens.

    `profile`: P(L >= i) ("p_accepted_ge") and P(D >= i) ("p_drafted_ge"), i = 1..k or more,
    over the step starts of a greedy run at a larger k (L accepted, D drafted; greedy output does
    not depend on k, so the same steps predict every smaller k). With D_k = min(D, k):
        tokens  = 1 + sum_{i=1..k} P(L >= i)
        seconds = E[D_k]·t_draft + E[v(D_k + 1)]·t_1 + o_step
    (t_draft: one draft forward, 0 for a model-free draft; t_1: a one-token target forward;
    o_step: the step's time outside both).
    """
    p_acc, p_dr = profile["p_accepted_ge"], profile["p_drafted_ge"]
    tokens = 1.0 + sum(p_acc[:k])
    ge = [1.0, *p_dr[:k], 0.0]  # P(D_k >= j), j = 0..k+1
    p_exact = [ge[j] - ge[j + 1] for j in range(k + 1)]  # P(D_k = j)
    mean_drafted = sum(j * p for j, p in enumerate(p_exact))
    verify = sum(p * v[j + 1] for j, p in enumerate(p_exact)) * t_1
    return tokens, mean_drafted * t_draft + verify + o_step
