"""`specdecode tune`: measure once, predict every k, recommend, then check the prediction.

1. Calibration: `ar` and every candidate drafter at k = k_max on the first `limit` prompts of
   each category (greedy). Greedy output does not depend on k, so one run per drafter gives the
   distribution of the accepted length L at every step start: P(L >= i) = accepted_at[i] /
   steps, and of the drafted length D (an n-gram drafter finds no match on some steps).
2. Costs: v(n) measured directly (auto/costs.py); the draft forward time and the Python
   overhead per step / per AR token from the calibration's timed forwards.
3. Prediction for every drafter, k <= k_max and category, with D_k = min(D, k):
       step time  = E[D_k]·t_draft + E[v(D_k + 1)]·t_1 + o_step     (t_draft = 0 model-free)
       tokens     = 1 + sum_{i=1..k} P(L >= i)
       speedup    = tokens / step time · (t_1 + o_ar)
   Each drafter's predictions in a category are then scaled so that k_max's equals the speedup
   its chain measured there (the model pools costs over categories; what it adds is how the
   speedup moves with k). Candidates that adapt as they run (`--k-policy heuristic,cost`) or
   draft token trees (`--tree`) are calibrated as they are, and their expected speedup is the
   one they measured on the calibration prompts. The recommendation per category is the best
   expectation; overall, the candidate with the best geometric mean over categories.
4. Validation: `ar` and the overall recommendation on the next `limit` prompts of each category
   (prompts the calibration did not see); measured vs expected speedup, per category and overall.
Writes DIR/tune.json, DIR/tune.md, DIR/config.json (`--config` for generate/bench/serve) and
DIR/vllm.json (vLLM's speculative_config, when the recommendation has one).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from specdecode.auto.costs import expected_chain_step, verify_costs
from specdecode.bench.aggregate import OVERALL, row_for
from specdecode.bench.methods import Setting, plan_settings
from specdecode.bench.records import Record
from specdecode.bench.report import format_interval
from specdecode.bench.runner import BenchConfig, load_bench_models, run_settings
from specdecode.config import RunConfig, save_config, to_vllm_speculative_config
from specdecode.core import metrics
from specdecode.core.draft_spec import DraftSpec
from specdecode.data.suites import BenchPrompt, interleave_by_category, load_suite
from specdecode.models.loading import LoadedModel


def split_prompts(
    prompts: list[BenchPrompt], limit: int
) -> tuple[list[BenchPrompt], list[BenchPrompt]]:
    """First `limit` prompts of each category for calibration, the next `limit` for validation."""
    seen: dict[str, int] = defaultdict(int)
    calibration, validation = [], []
    for prompt in prompts:
        index = seen[prompt.category]
        seen[prompt.category] += 1
        if index < limit:
            calibration.append(prompt)
        elif index < 2 * limit:
            validation.append(prompt)
    return calibration, validation


def _pooled(records: list[Record], field: str) -> list[int]:
    total: list[int] = []
    for r in records:
        for i, value in enumerate(getattr(r, field) or []):
            if i == len(total):
                total.append(0)
            total[i] += value
    return total


def step_profile(records: list[Record], k_max: int) -> dict[str, list[float]]:
    """P(L >= i) and P(D >= i), i = 1..k_max, over every step of `records` (one drafter)."""
    steps = sum(r.steps for r in records)
    accepted = _pooled(records, "accepted_at") + [0] * k_max
    drafted = _pooled(records, "drafted_at") + [0] * k_max
    return {
        "p_accepted_ge": [accepted[i] / steps for i in range(k_max)],
        "p_drafted_ge": [drafted[i] / steps for i in range(k_max)],
    }


def predict_speedup(
    profile: dict[str, list[float]],
    k: int,
    v: dict[int, float],
    t_draft: float,
    t_1: float,
    o_step: float,
    o_ar: float,
) -> float:
    """Predicted decode speedup at look-ahead k (module docstring, step 3); times in seconds."""
    tokens, step = expected_chain_step(profile, k, v, t_draft, t_1, o_step)
    return tokens / step * (t_1 + o_ar)


def measured_costs(ar: list[Record], spec: list[Record]) -> dict[str, float]:
    """t_1, o_ar from `ar` records; t_draft, o_step from one drafter's spec records (seconds)."""

    def total(records: list[Record], field: str) -> float:
        return sum(getattr(r, field) or 0 for r in records)

    def decode_time(records: list[Record]) -> float:
        return sum(r.wall_time_s - (r.prefill_s or 0.0) for r in records)

    t_1 = total(ar, "target_forward_s") / total(ar, "target_forwards")
    o_ar = decode_time(ar) / total(ar, "steps") - t_1
    forwards = total(spec, "target_forward_s") + total(spec, "draft_forward_s")
    o_step = (decode_time(spec) - forwards) / total(spec, "steps")
    draft_calls = total(spec, "draft_forwards")
    t_draft = total(spec, "draft_forward_s") / draft_calls if draft_calls else 0.0
    return {"t_1": t_1, "o_ar": max(o_ar, 0.0), "o_step": max(o_step, 0.0), "t_draft": t_draft}


def _candidate(setting: Setting, category: str, predicted: float, how: str) -> dict[str, Any]:
    return {
        "setting": setting.label,
        "draft": setting.draft,
        "k": setting.k,
        "policy": setting.policy,
        "tree": setting.tree,
        "category": category,
        "predicted": predicted,
        # "model": the chain prediction of step 3; "anchored": that prediction scaled to what the
        # chain measured at k_max; "calibration": measured there
        "how": how,
    }


def setting_of(row: dict[str, Any]) -> Setting:
    """The bench setting a prediction row stands for."""
    return Setting("spec", row["draft"], row["k"], row["policy"], row["tree"])


def _with_overall(rows: list[dict[str, Any]], n_categories: int) -> list[dict[str, Any]]:
    """`rows` (one candidate, per category) plus its geometric mean over categories; a candidate
    without a figure in some category (`rows` shorter) gets no overall one."""
    if len(rows) < n_categories or not rows:
        return rows
    overall = metrics.geometric_mean([r["predicted"] for r in rows])
    hows = {r["how"] for r in rows}
    how = hows.pop() if len(hows) == 1 else "anchored"  # partly measured, partly predicted
    return [*rows, {**rows[0], "category": OVERALL, "predicted": overall, "how": how}]


def predictions(
    records: list[Record],
    drafts: list[str],
    k_max: int,
    v: dict[int, float],
    summary: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Predicted speedup for every fixed-k chain: drafter x k <= k_max x category (+ overall),
    from the calibration run of each drafter at k_max (step 3).

    With the calibration's `summary`, each drafter's predictions in a category are scaled so that
    k_max's equals the speedup its chain measured there: the chain then stands on the footing of
    the trees and k policies beside it (their figures are measured), and the model carries only
    what it is for, how the speedup moves with k. (The model pools draft time and step overhead
    over categories, which put its k_max figure well off the measured one in some categories:
    docs/results.md.)"""
    ar = [r for r in records if r.method == "ar"]
    categories = list(dict.fromkeys(r.category for r in records))
    rows = []
    for draft in drafts:
        spec = [
            r
            for r in records
            if r.method == "spec"
            and r.draft == draft
            and r.k == k_max
            and r.k_policy == "fixed"
            and r.tree is None
        ]
        costs = measured_costs(ar, spec)
        speedups = {}  # (k, category) -> predicted speedup
        how = {}  # (k, category) -> "model", "anchored" or "calibration" (see _candidate)
        for category in categories:
            profile = step_profile([r for r in spec if r.category == category], k_max)
            for k in range(1, k_max + 1):
                speedups[k, category] = predict_speedup(profile, k, v, **costs)
                how[k, category] = "model"
            measured = _measured(summary, Setting("spec", draft, k_max).label, category)
            if measured is not None and speedups[k_max, category] > 0:
                scale = measured / speedups[k_max, category]
                for k in range(1, k_max + 1):
                    speedups[k, category] *= scale
                    how[k, category] = "calibration" if k == k_max else "anchored"
        for k in range(1, k_max + 1):
            per_category = [
                _candidate(Setting("spec", draft, k), c, speedups[k, c], how[k, c])
                for c in categories
            ]
            rows += _with_overall(per_category, len(categories))
    return rows


def _measured(summary: dict[str, Any] | None, label: str, category: str) -> float | None:
    if summary is None:
        return None
    try:
        return row_for(summary, label, category)["speedup"]
    except KeyError:
        return None


def calibrated(summary: dict[str, Any], settings: list[Setting]) -> list[dict[str, Any]]:
    """Candidates that adapt as they run (k policies) or draft trees cannot be extrapolated from
    a chain at k_max: their prediction is the speedup they measured on the calibration prompts,
    per category (paired geometric mean over its prompts) and over categories. A category where
    it has no decode rate (every answer came in its first block) gives it no figure there."""
    rows = []
    for setting in settings:
        measured = {c: row_for(summary, setting.label, c)["speedup"] for c in summary["categories"]}
        per_category = [
            _candidate(setting, c, speedup, "calibration")
            for c, speedup in measured.items()
            if speedup is not None
        ]
        rows += _with_overall(per_category, len(measured))
    return rows


def recommend(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The best predicted candidate per category and overall."""
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        held = best.get(row["category"])
        if held is None or row["predicted"] > held["predicted"]:
            best[row["category"]] = row
    return best


def _drafting(row: dict[str, Any]) -> dict[str, Any]:
    """A recommendation as RunConfig keys (all of them, so a category override is complete);
    a tree has no k (bench's 0), the config's k >= 1 is then unused."""
    k = max(row["k"], 1)
    return {"draft": row["draft"], "k": k, "k_policy": row["policy"], "tree": row["tree"]}


def run_tune(
    config: BenchConfig, k_max: int, validate: bool = True, progress: bool = True
) -> dict[str, Any]:
    """Calibrate, predict, recommend and (optionally) validate; write the files in config.out."""
    config.validate()
    if not config.drafts:
        raise ValueError("tune needs at least one candidate --draft")
    if config.temperature:
        raise ValueError("tune calibrates greedy decoding: leave --temperature at 0")
    if config.trees and not any(DraftSpec.parse(d).drafts_trees for d in config.drafts):
        raise ValueError(
            "--tree needs a model draft among the candidates (a model, early-exit:N or eagle3:DIR)"
        )
    calibration, validation = _tune_prompts(config, validate)
    # the tuner predicts decode speedups, which exclude the prefill: one target prefill per
    # prompt, shared by every candidate, saves that time and changes no figure it uses
    config = replace(config, share_prefill=True)
    target, drafts = load_bench_models(config)
    records, cal_summary, direct = _calibrate(config, target, drafts, k_max, calibration, progress)
    v = verify_costs(target.model, k_max + 1)  # step 2 (the other costs come from the records)
    chains = [d for d in config.drafts if not sizes_itself(d)]
    rows = predictions(records, chains, k_max, v, cal_summary)  # step 3: chains
    rows += calibrated(cal_summary, direct)  # ... and what adapts as it runs
    best = recommend(rows)
    result: dict[str, Any] = {
        "command": config.command,
        "k_max": k_max,
        "v": v,
        "predictions": rows,
        "recommended": best,
        "validation": None,
    }
    if validate:
        chosen = setting_of(best[OVERALL])
        result["validation"] = _validate(config, target, drafts, chosen, rows, validation, progress)
    _write_tune(config, result)
    return result


def _tune_prompts(
    config: BenchConfig, validate: bool
) -> tuple[list[BenchPrompt], list[BenchPrompt]]:
    """The calibration prompts and the validation ones (`split_prompts` on `config.limit`)."""
    limit = config.limit or 2
    prompts = load_suite(config.prompts_file, categories=config.categories, limit=2 * limit)
    calibration, validation = split_prompts(prompts, limit)
    if validate and not validation:
        raise ValueError(
            f"no prompts left to validate on: each category needs more than {limit} prompts "
            "(lower --limit or pass --no-validate)"
        )
    return calibration, validation


def sizes_itself(draft: str) -> bool:
    """A draft that picks its own tree or chain each step (`suffix`, `MODEL+suffix`): measured
    as it runs, never extrapolated from one k."""
    return DraftSpec.parse(draft).kind in ("suffix", "hybrid")


def _calibrate(
    config: BenchConfig,
    target: LoadedModel,
    drafts: dict[str, Any],
    k_max: int,
    prompts: list[BenchPrompt],
    progress: bool,
) -> tuple[list[Record], dict[str, Any], list[Setting]]:
    """Step 1: `ar` and every candidate on the calibration prompts (in DIR/calibration).
    Returns the records, their summary and the candidates measured rather than extrapolated."""
    # fixed-k chains at k_max (extrapolated to every k), then the adaptive policies and trees
    policies = ["fixed", *(p for p in config.policies if p != "fixed")]
    candidates = plan_settings(["spec"], drafts, [k_max], policies, config.trees, target=target)
    direct = [
        s
        for s in candidates
        if s.policy != "fixed" or s.tree is not None or sizes_itself(s.draft or "")
    ]
    records, summary = run_settings(
        replace(config, out=str(Path(config.out) / "calibration")),
        target,
        drafts,
        [Setting("ar"), *candidates],
        interleave_by_category(prompts),
        progress,
    )
    return records, summary, direct


def _validate(
    config: BenchConfig,
    target: LoadedModel,
    drafts: dict[str, Any],
    chosen: Setting,
    rows: list[dict[str, Any]],
    prompts: list[BenchPrompt],
    progress: bool,
) -> dict[str, Any]:
    """Step 4: `ar` and `chosen` on the validation prompts (in DIR/validation); the measured
    speedup beside the predicted one (`rows`), per category and over categories."""
    _, summary = run_settings(
        replace(config, out=str(Path(config.out) / "validation")),
        target,
        drafts,
        [Setting("ar"), chosen],
        interleave_by_category(prompts),
        progress,
    )
    per_category: dict[str, dict[str, Any]] = {}
    for category in [*summary["categories"], OVERALL]:
        aggregate = row_for(summary, chosen.label, category)
        if category == OVERALL:  # averaged like the prediction: over categories
            measured = metrics.geometric_mean(
                [row["measured"] for row in per_category.values() if row["measured"]]
            )
        else:
            measured = aggregate["speedup"]
        predicted = next(
            r["predicted"]
            for r in rows
            if r["setting"] == chosen.label and r["category"] == category
        )
        per_category[category] = {
            "predicted": predicted,
            "measured": measured,
            "error": measured / predicted - 1 if measured else None,
            # how sure the measured speedup is: over the category's prompts (overall, over
            # every validation prompt); None with one prompt
            "interval": aggregate.get("speedup_interval"),
        }
    return {"setting": chosen.label, "per_category": per_category}


def _write_tune(config: BenchConfig, result: dict[str, Any]) -> None:
    """DIR/config.json and vllm.json from the recommendation (a note in `result` where vLLM has
    no counterpart), then tune.json and tune.md."""
    best = result["recommended"]
    run_config = RunConfig(
        target=config.target,
        **_drafting(best[OVERALL]),
        dtype=config.dtype,
        device=config.device,
        per_category={c: _drafting(r) for c, r in best.items() if c != OVERALL},
    )
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(run_config, out / "config.json")
    try:
        (out / "vllm.json").write_text(json.dumps(to_vllm_speculative_config(run_config), indent=2))
    except ValueError as err:  # early exit and trees have no vLLM counterpart: say so
        result["vllm"] = str(err)
    (out / "tune.json").write_text(json.dumps(result, indent=1))
    (out / "tune.md").write_text(render_tune(result))


def _how(row: dict[str, Any]) -> str:
    return {
        "model": "predicted",
        "anchored": "predicted, scaled to the measured k_max",
    }.get(row["how"], "measured in calibration")


def render_tune(result: dict[str, Any]) -> str:
    best = result["recommended"]
    lines = [
        "# Tuning report",
        "",
        f"Command: `{result['command']}`",
        "",
        "Expected decode speedup over the target alone. Fixed-k chains are predicted for every k "
        f"from one calibration run per drafter at k = {result['k_max']}, the measured v(n) and "
        f"forward times, scaled per category to what the chain measured at k = {result['k_max']}; "
        "k policies and token trees adapt as they run, so their figure is the speedup they "
        "measured on the calibration prompts.",
        "",
        "| category | recommended | expected | from |",
        "|---|---|---|---|",
    ]
    for category, row in best.items():
        lines.append(f"| {category} | {row['setting']} | {row['predicted']:.2f}x | {_how(row)} |")
    overall = sorted(
        (r for r in result["predictions"] if r["category"] == OVERALL),
        key=lambda r: -r["predicted"],
    )
    lines += ["", "Every candidate over all categories:", "", "| candidate | expected | from |"]
    lines.append("|---|---|---|")
    lines += [f"| {r['setting']} | {r['predicted']:.2f}x | {_how(r)} |" for r in overall]
    v = ", ".join(f"v({n}) = {x:.2f}" for n, x in result["v"].items())
    lines += ["", f"Verification cost: {v}.", ""]
    validation = result.get("validation")
    if validation:
        lines += [
            f"## Validation of `{validation['setting']}` on prompts the calibration did not see",
            "",
            "The interval: 95%, a bootstrap over the validation prompts (`bench` reports say "
            "how); with one prompt a category there is none. An error inside it is noise.",
            "",
            "| category | expected | measured | 95% interval | error |",
            "|---|---|---|---|---|",
        ]
        for category, row in validation["per_category"].items():
            measured = "-" if row["measured"] is None else f"{row['measured']:.2f}x"
            error = "-" if row["error"] is None else f"{row['error']:+.0%}"
            interval = format_interval(row.get("interval"))  # absent from older results
            lines.append(
                f"| {category} | {row['predicted']:.2f}x | {measured} | {interval} | {error} |"
            )
    if "vllm" in result:
        lines += ["", f"No vLLM export: {result['vllm']}"]
    return "\n".join(lines) + "\n"
