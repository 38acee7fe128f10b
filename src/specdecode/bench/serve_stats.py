"""A serving load run's per-request records -> per level and per category statistics.

Pure functions of the records `bench-serve` writes to results.jsonl (one dict per request), so a
saved run can be summarized again. Definitions:

- a level's **wall time**: from its first request's start to its last request's end
  (`end_s`, seconds from the level's start);
- **total tokens/s**: the completion tokens of its successful requests / its wall time (per
  category: that category's tokens over the same wall time, its share of the throughput);
- **TTFT**: the first content chunk after the request was sent; **ITL**: the gaps between
  content chunks, pooled over requests (a chunk may carry several tokens); **TPOT**: a request's
  time after its first chunk / (completion tokens - 1), the mean time per token that follows;
- **errors**: failed requests other than 429 (`rate_limited`, counted apart); latencies and
  tokens are over successful requests only.

Percentiles interpolate linearly between the closest ranks (numpy's default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from specdecode.bench.serve_client import OK, RATE_LIMITED

PERCENTILES = (50, 95, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of `values`; None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100 (got {q})")
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def distribution(values: Iterable[float]) -> dict[str, float | int | None]:
    """n, mean and the PERCENTILES of `values` (None where there are none)."""
    xs = list(values)
    stats: dict[str, float | int | None] = {"n": len(xs), "mean": sum(xs) / len(xs) if xs else None}
    stats.update({f"p{q}": percentile(xs, q) for q in PERCENTILES})
    return stats


def per_request(record: dict[str, Any]) -> dict[str, float | None]:
    """A successful request's tokens/s (completion tokens / latency) and TPOT."""
    tokens, latency, ttft = record["completion_tokens"], record["latency_s"], record["ttft_s"]
    if record["kind"] != OK or not tokens:
        return {"tokens_per_s": None, "tpot_s": None}
    tpot = None
    if tokens > 1 and ttft is not None:
        tpot = (latency - ttft) / (tokens - 1)
    return {"tokens_per_s": tokens / latency if latency > 0 else None, "tpot_s": tpot}


def summarize_requests(records: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Counts, throughput over `wall_s` and latency distributions of `records`."""
    ok = [r for r in records if r["kind"] == OK]
    kinds = Counter(r["kind"] for r in records if r["kind"] != OK)
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    counted = [r for r in ok if r["token_source"] == "usage" and r["chunks"]]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(n for kind, n in kinds.items() if kind != RATE_LIMITED),
        "rate_limited": kinds.get(RATE_LIMITED, 0),
        "errors_by_kind": dict(sorted(kinds.items())),
        "completion_tokens": tokens,
        "wall_s": wall_s,
        "total_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        # where the server counts tokens: how many one content chunk carries on average
        "tokens_per_chunk": (
            sum(r["completion_tokens"] for r in counted) / sum(r["chunks"] for r in counted)
            if counted
            else None
        ),
        "ttft_s": distribution(r["ttft_s"] for r in ok if r["ttft_s"] is not None),
        "itl_s": distribution(gap for r in ok for gap in r["itl_s"]),
        "tpot_s": distribution(r["tpot_s"] for r in ok if r["tpot_s"] is not None),
        "latency_s": distribution(r["latency_s"] for r in ok),
        "request_tokens_per_s": distribution(
            r["tokens_per_s"] for r in ok if r["tokens_per_s"] is not None
        ),
    }


def summarize_level(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency level's statistics, overall and per category (in order of appearance)."""
    if not records:
        raise ValueError("a level without requests")
    concurrency = {r["concurrency"] for r in records}
    if len(concurrency) != 1:
        raise ValueError(f"records of several levels in one: {sorted(concurrency)}")
    wall = max(r["end_s"] for r in records) - min(r["start_s"] for r in records)
    by_category: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_category.setdefault(r["category"], []).append(r)
    return {
        "concurrency": concurrency.pop(),
        **summarize_requests(records, wall),
        "per_category": {c: summarize_requests(rs, wall) for c, rs in by_category.items()},
    }


def summarize_levels(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every level's statistics, in the order the levels ran."""
    levels: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        levels.setdefault(r["concurrency"], []).append(r)
    return [summarize_level(rs) for rs in levels.values()]


def token_sources(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How the successful requests' tokens were counted: {"usage": n, "chunks": m}."""
    counts = Counter(r["token_source"] for r in records if r["kind"] == OK)
    return {source: counts.get(source, 0) for source in ("usage", "chunks")}
