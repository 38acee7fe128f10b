"""Records -> aggregates per setting x category (and overall): the numbers a report shows.

Pairing: a setting's record is compared with the `ar` record of the same prompt, turn and repeat.
- speedup = geometric mean over prompts of decode tokens/s (after the first block, so prefill is
  apart) of the setting / of `ar`; `e2e_speedup` the same on whole-generation tokens/s.
- acceptance, mean acceptance length, per-position acceptance: pooled counters (metrics.py).
- c = one draft forward / one `ar` target forward, v(k) = one verification forward / one `ar`
  target forward, from the timed forwards of the same prompts; ideal = metrics.ideal_speedup
  for fixed-k settings; efficiency = speedup / ideal.
- vs_hf_assisted: geometric mean of per-prompt decode tokens/s against the hf-assisted setting
  that was fastest overall (`best_hf_assisted`); vs_best_hf likewise against HF's fastest method.
- speedup_interval: how sure the speedup is, a bootstrap interval over prompts
  (metrics.geometric_mean_interval); against_fastest: each setting paired with the fastest one
  of each category, the ratio and its interval; one_token_ms: the target alone's forward time
  over the run (least, median, most): how steady the machine was.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from specdecode.bench.records import Record
from specdecode.core import metrics

OVERALL = "all"


def _key(record: Record) -> tuple:
    return (record.prompt_id, record.turn, record.repeat)


def baseline_map(records: Iterable[Record]) -> dict[tuple, Record]:
    """`records` keyed the way `paired_ratio` pairs them (prompt, turn, repeat): a baseline."""
    return {_key(r): r for r in records}


def _sum(records: Iterable[Record], field: str) -> float:
    return sum(getattr(r, field) or 0 for r in records)


def paired_ratios(
    records: list[Record], baseline: dict[tuple, Record], field: str = "decode_tokens_per_s"
) -> dict[str, list[float]]:
    """record.field / baseline.field for every record with a usable pair, by prompt (its turns
    and repeats together)."""
    ratios: dict[str, list[float]] = defaultdict(list)
    for record in records:
        base = baseline.get(_key(record))
        ours, theirs = getattr(record, field), getattr(base, field, None)
        if ours and theirs:
            ratios[record.prompt_id].append(ours / theirs)
    return ratios


def paired_ratio(
    records: list[Record], baseline: dict[tuple, Record], field: str = "decode_tokens_per_s"
) -> float | None:
    """Geometric mean of record.field / baseline.field over records with a usable pair."""
    by_prompt = paired_ratios(records, baseline, field)
    return metrics.geometric_mean([r for ratios in by_prompt.values() for r in ratios])


def paired_interval(
    records: list[Record], baseline: dict[tuple, Record], field: str = "decode_tokens_per_s"
) -> list[float] | None:
    """How sure `paired_ratio` is: its bootstrap interval over prompts
    (`metrics.geometric_mean_interval`) as [low, high], as summary.json holds it; None with
    fewer than two prompts."""
    bounds = metrics.geometric_mean_interval(list(paired_ratios(records, baseline, field).values()))
    return None if bounds is None else list(bounds)


def _per_call(records: Iterable[Record], kind: str) -> float | None:
    records = list(records)
    return metrics.ratio(_sum(records, f"{kind}_forward_s"), _sum(records, f"{kind}_forwards"))


def _pooled_positions(records: list[Record]) -> list[float | None] | None:
    drafted: list[int] = []
    accepted: list[int] = []
    for r in records:
        if r.drafted_at is None or r.accepted_at is None:
            continue  # a server that did not say how many it drafted at each position
        for i, (d, a) in enumerate(zip(r.drafted_at, r.accepted_at, strict=True)):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    return metrics.per_position_acceptance(accepted, drafted) if drafted else None


def _mean(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def aggregate_group(
    records: list[Record], ar: list[Record], baselines: dict[str, dict[tuple, Record]]
) -> dict[str, Any]:
    """The aggregates of one setting over one group of prompts (a category or all)."""
    first = records[0]
    row: dict[str, Any] = {
        "setting": first.setting,
        "method": first.method,
        "draft": first.draft,
        "k": first.k,
        "k_policy": first.k_policy,
        "tree": first.tree,
        "prompts": len(records),
        "new_tokens": _sum(records, "new_tokens"),
        "tokens_per_s": _mean(r.tokens_per_s for r in records),
        "decode_tokens_per_s": _mean(r.decode_tokens_per_s for r in records),
        "ttft_s": _mean(r.ttft_s for r in records),
        "speedup": paired_ratio(records, baselines["ar"]),
        # the baseline against itself: 1.00x with nothing to be unsure of
        "speedup_interval": None
        if first.setting == "ar"
        else paired_interval(records, baselines["ar"]),
        "e2e_speedup": paired_ratio(records, baselines["ar"], "tokens_per_s"),
        "peak_memory_bytes": max(r.peak_memory_bytes or 0 for r in records),
    }
    if first.tuned:  # a tuned config runs a different setting per category
        ran = {r.ran for r in records}
        row["ran"] = ran.pop() if len(ran) == 1 else "per category"
        if row["ran"] == "per category":
            row.update(draft="per category", k=0, tree=None)
        row["k_policy"] = "tuned"  # keeps it out of the chain theory, best k and k plots
    ar_memory = max((r.peak_memory_bytes or 0 for r in ar), default=0)
    row["memory_overhead"] = metrics.ratio(row["peak_memory_bytes"], ar_memory)
    for name in ("hf-ar", "hf-assisted", "best-hf"):
        if name in baselines:
            column = "vs_" + name.replace("-", "_")
            row[column] = paired_ratio(records, baselines[name])
    greedy = [r for r in records if r.identical_to_ar is not None]
    row["identical"] = sum(bool(r.identical_to_ar) for r in greedy)
    row["compared"] = len(greedy)
    # a server's counters (bench --server) where it exports them; our engine's always
    counted = first.method == "spec" or any(r.drafted is not None for r in records)
    if first.method == "ar" or not counted:
        return row

    drafted, accepted = _sum(records, "drafted"), _sum(records, "accepted")
    row["acceptance_rate"] = metrics.acceptance_rate(int(accepted), int(drafted))
    row["mean_acceptance_length"] = metrics.mean_acceptance_length(
        int(_sum(records, "emitted")), int(_sum(records, "steps"))
    )
    row["per_position_acceptance"] = _pooled_positions(records)
    one_token = _per_call(ar, "target")
    draft_call = _per_call(records, "draft")
    verify_call = _per_call(records, "target")
    row["c"] = metrics.ratio(draft_call or 0.0, one_token) if one_token else None
    row["v"] = metrics.ratio(verify_call, one_token) if one_token and verify_call else None
    ideal = None
    chain = row["k_policy"] == "fixed" and not row["tree"]  # the theory is for chains
    if chain and None not in (row["acceptance_rate"], row["c"], row["v"]):
        ideal = metrics.ideal_speedup(row["acceptance_rate"], first.k, row["c"], row["v"])
    row["ideal_speedup"] = ideal
    row["efficiency"] = (
        metrics.efficiency(row["speedup"], ideal) if ideal and row["speedup"] else None
    )
    return row


def _best(rows: list[dict[str, Any]], accept: Callable[[dict[str, Any]], bool]) -> str | None:
    candidates = [r for r in rows if accept(r) and r["speedup"] is not None]
    return max(candidates, key=lambda r: r["speedup"])["setting"] if candidates else None


def _in(records: list[Record], category: str) -> list[Record]:
    return [r for r in records if category == OVERALL or r.category == category]


def against_fastest(
    by_setting: dict[str, list[Record]], rows: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per category (and overall): the setting of the highest speedup there, and every other
    setting's decode tokens/s over its, prompt by prompt: the paired ratio and its interval
    (`paired_interval`). Paired on the same prompts, the prompts' own spread cancels: what is
    left says whether a setting is behind the fastest by more than this run's noise."""
    out: dict[str, dict[str, Any]] = {}
    for category in dict.fromkeys(r["category"] for r in rows):
        ranked = [r for r in rows if r["category"] == category and r["speedup"] is not None]
        if len(ranked) < 2:
            continue
        fastest = max(ranked, key=lambda r: r["speedup"])["setting"]
        baseline = baseline_map(_in(by_setting[fastest], category))
        ratios = {}
        for row in ranked:
            if row["setting"] != fastest:
                chosen = _in(by_setting[row["setting"]], category)
                ratios[row["setting"]] = {
                    "ratio": paired_ratio(chosen, baseline),
                    "interval": paired_interval(chosen, baseline),
                }
        out[category] = {"fastest": fastest, "ratios": ratios}
    return out


def steadiness(ar: list[Record]) -> dict[str, Any] | None:
    """How steady the machine ran: the target alone's mean forward time per record (one token
    after the first), its least, median and most in ms over the run's `ar` records; None
    without timed forwards (a server's records). About the same forward on every prompt (the
    weights dominate it; only the attention grows with the context), so its spread is mostly
    the machine's (a shared VM's neighbours), which every setting's time shares."""
    times = sorted(
        1000 * r.target_forward_s / r.target_forwards
        for r in ar
        if r.target_forwards and r.target_forward_s
    )
    if not times:
        return None
    return {
        "records": len(times),
        "min": times[0],
        "median": statistics.median(times),
        "max": times[-1],
    }


def summarize(records: list[Record]) -> dict[str, Any]:
    """Aggregates per setting x category and overall, best settings, and every divergence."""
    if not records:
        raise ValueError("no records to summarise")
    settings = list(dict.fromkeys(r.setting for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    by_setting: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_setting[r.setting].append(r)
    servers_only = all(r.method in ("ar", "server") for r in records)
    if "ar" not in by_setting and not servers_only:
        raise ValueError("the records have no `ar` baseline: run with the `ar` method")
    baselines = {"ar": {_key(r): r for r in by_setting["ar"]}}
    if "hf-ar" in by_setting:
        baselines["hf-ar"] = {_key(r): r for r in by_setting["hf-ar"]}

    def rows_for(category: str | None) -> list[dict[str, Any]]:
        """Aggregates of every setting over one category (None: all prompts)."""

        within = OVERALL if category is None else category
        ar = _in(by_setting["ar"], within)
        rows = []
        for s in settings:
            chosen = _in(by_setting[s], within)
            if chosen:
                rows.append(
                    dict(aggregate_group(chosen, ar, baselines), category=category or OVERALL)
                )
        return rows

    # first pass: find HF's fastest settings overall, then compare every setting against them
    overall = rows_for(None)
    best_assisted = _best(overall, lambda r: r["method"] == "hf-assisted")
    best_hf = _best(overall, lambda r: r["method"] in ("hf-assisted", "hf-prompt-lookup"))
    if best_assisted:
        baselines["hf-assisted"] = {_key(r): r for r in by_setting[best_assisted]}
    if best_hf:
        baselines["best-hf"] = {_key(r): r for r in by_setting[best_hf]}
    rows = rows_for(None)
    for category in categories:
        rows += rows_for(category)

    best_k: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if row["method"] != "spec" or row["speedup"] is None or row["tree"]:
            continue  # best k is a chain question; trees are compared in the tables
        if row["k_policy"] == "tuned":
            continue
        label = f"{row['draft']} ({row['k_policy']})"
        held = best_k[row["category"]].get(label)
        if held is None or row["speedup"] > held["speedup"]:
            best_k[row["category"]][label] = {"k": row["k"], "speedup": row["speedup"]}

    divergences = [
        {
            "prompt_id": r.prompt_id,
            "category": r.category,
            "turn": r.turn,
            "setting": r.setting,
            **r.first_divergence,
        }
        for r in records
        if r.first_divergence
    ]
    return {
        "settings": settings,
        "categories": categories,
        "rows": rows,
        "best_k": dict(best_k),
        "against_fastest": against_fastest(by_setting, rows),
        "one_token_ms": steadiness(by_setting["ar"]),
        "best_spec": _best(overall, lambda r: r["method"] == "spec"),
        "best_hf_assisted": best_assisted,
        "best_hf": best_hf,
        "divergences": divergences,
    }


def row_for(summary: dict[str, Any], setting: str, category: str = OVERALL) -> dict[str, Any]:
    for row in summary["rows"]:
        if row["setting"] == setting and row["category"] == category:
            return row
    raise KeyError(f"no aggregate for {setting!r} in {category!r}")
