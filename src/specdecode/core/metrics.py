"""Counters -> rates, and the theory they are compared with. The one place rates are defined.

Definitions (DESIGN.md glossary):
- acceptance rate α = accepted / drafted
- mean acceptance length τ = emitted / steps (includes the recovered or bonus token of each step)
- per-position acceptance = accepted at position i / drafted at position i, i = 1..k
- with i.i.d. acceptance α, expected tokens emitted per step = (1 - α^(k+1)) / (1 - α)
- ideal speedup = expected emitted per step / (k·c + v(k)), c = draft forward / target forward,
  v(k) = target forward over k+1 tokens / over 1 token
- efficiency = measured speedup / ideal speedup
- speedups over prompts are averaged geometrically (the mean of ratios that composes)
- how sure a mean of speedups is: a bootstrap interval over prompts (`geometric_mean_interval`)
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

INTERVAL_LEVEL = 0.95  # the share of resampled means an interval holds
RESAMPLES = 2000


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is zero (rate undefined)."""
    return numerator / denominator if denominator else None


def acceptance_rate(accepted: int, drafted: int) -> float | None:
    return ratio(accepted, drafted)


def mean_acceptance_length(emitted: int, steps: int) -> float | None:
    return ratio(emitted, steps)


def per_position_acceptance(
    accepted_at: Sequence[int], drafted_at: Sequence[int]
) -> list[float | None]:
    return [ratio(a, d) for a, d in zip(accepted_at, drafted_at, strict=True)]


def expected_emitted_per_step(alpha: float, k: int) -> float:
    """(1 - α^(k+1)) / (1 - α): expected tokens per step under i.i.d. acceptance α."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (got {alpha})")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def ideal_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float) -> float:
    """Expected speedup over autoregressive decoding: emitted per step / (k·c + v(k))."""
    return expected_emitted_per_step(alpha, k) / (k * cost_ratio + verify_cost)


def efficiency(measured_speedup: float, ideal: float) -> float | None:
    return ratio(measured_speedup, ideal)


def geometric_mean(values: Sequence[float]) -> float | None:
    """exp(mean(log x)) of positive values: the mean of ratios (speedups); None when empty."""
    if not values:
        return None
    if any(v <= 0 for v in values):
        raise ValueError("the geometric mean needs positive values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def geometric_mean_interval(
    groups: Sequence[Sequence[float]],
    level: float = INTERVAL_LEVEL,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> tuple[float, float] | None:
    """A percentile bootstrap interval of the geometric mean of positive ratios that come in
    groups (a prompt's repeats and turns: they move together, so a group is resampled whole).
    The groups are drawn with replacement `resamples` times; the interval holds the middle
    `level` of the resampled means. Seeded, so a report renders the same interval every time.
    None with fewer than two groups (nothing to resample). Few groups give too narrow an
    interval, not too wide: with four prompts it says at least this much noise."""
    kept = [[math.log(v) for v in group] for group in groups if group]
    if len(kept) < 2:
        return None
    if not 0 < level < 1 or resamples < 1:
        raise ValueError("level in (0, 1) and resamples >= 1 needed")
    sums = [(sum(logs), len(logs)) for logs in kept]
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        drawn = rng.choices(sums, k=len(sums))
        means.append(sum(s for s, _ in drawn) / sum(n for _, n in drawn))
    means.sort()
    tail = (1 - level) / 2
    low = means[int(tail * (resamples - 1))]
    high = means[math.ceil((1 - tail) * (resamples - 1))]
    return math.exp(low), math.exp(high)
