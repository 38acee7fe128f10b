"""Summary -> DIR/report.md and DIR/*.png. Reads only saved data, so `specdecode report` re-renders.

Every number shown is one the run measured (aggregate.py says how each is computed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdecode.bench.aggregate import OVERALL
from specdecode.bench.records import Record

PLOTS = {
    "acceptance_by_category.png": "acceptance rate by category",
    "speedup_vs_k.png": "speedup over the target alone vs k, per category",
    "per_position_acceptance.png": "acceptance at each draft position",
    "measured_vs_ideal.png": "measured speedup vs the ideal from measured α, c and v(k)",
}


def _f(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{format(value, spec)}{suffix}"


def _mb(n_bytes: Any) -> str:
    return "-" if not n_bytes else f"{n_bytes / 2**20:,.0f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def format_interval(bounds: Any, suffix: str = "x") -> str:
    """A (low, high) interval as `1.72-2.01x`; `-` where there is none."""
    return "-" if not bounds else f"{bounds[0]:.2f}-{bounds[1]:.2f}{suffix}"


def _rows(summary: dict[str, Any], category: str) -> list[dict[str, Any]]:
    return [r for r in summary["rows"] if r["category"] == category]


def overall_table(summary: dict[str, Any]) -> str:
    header = [
        "setting",
        "tok/s",
        "decode tok/s",
        "decode speedup",
        "95% interval",
        "e2e speedup",
        "α",
        "τ",
        "c",
        "v(k)",
        "ideal",
        "efficiency",
        "vs hf-assisted",
        "vs best HF",
        "identical",
    ]
    rows = []
    for r in _rows(summary, OVERALL):
        rows.append(
            [
                r["setting"],
                _f(r["tokens_per_s"]),
                _f(r["decode_tokens_per_s"]),
                _f(r["speedup"], suffix="x"),
                format_interval(r.get("speedup_interval")),
                _f(r["e2e_speedup"], suffix="x"),
                _f(r.get("acceptance_rate")),
                _f(r.get("mean_acceptance_length")),
                _f(r.get("c")),
                _f(r.get("v")),
                _f(r.get("ideal_speedup"), suffix="x"),
                _f(r.get("efficiency")),
                _f(r.get("vs_hf_assisted"), suffix="x"),
                _f(r.get("vs_best_hf"), suffix="x"),
                f"{r['identical']}/{r['compared']}" if r["compared"] else "-",
            ]
        )
    return _table(header, rows)


def category_table(summary: dict[str, Any]) -> str:
    """Decode speedup (and acceptance where drafted) of every setting in every category."""
    settings = summary["settings"]
    header = ["category", *settings]
    rows = []
    for category in [*summary["categories"], OVERALL]:
        by_setting = {r["setting"]: r for r in _rows(summary, category)}
        cells = [category]
        for s in settings:
            r = by_setting.get(s)
            if r is None:
                cells.append("-")
                continue
            cell = _f(r["speedup"], suffix="x")
            if r.get("acceptance_rate") is not None:
                cell += f" (α {r['acceptance_rate']:.2f})"
            if r.get("ran") and category != OVERALL:  # what a tuned config ran there
                cell += f" [{r['ran']}]"
            cells.append(cell)
        rows.append(cells)
    return _table(header, rows)


def fastest_table(summary: dict[str, Any]) -> str:
    """Every setting against the fastest of each category, paired prompt by prompt."""
    against = summary.get("against_fastest")  # absent from summaries saved before it
    if not against:
        return "(one setting, or one prompt: nothing to pair)"
    settings = summary["settings"]
    rows = []
    for category in [*summary["categories"], OVERALL]:
        held = against.get(category)
        if held is None:
            continue
        cells = [category]
        for s in settings:
            if s == held["fastest"]:
                cells.append("**fastest**")
            elif s in held["ratios"]:
                pair = held["ratios"][s]
                cells.append(
                    f"{_f(pair['ratio'], suffix='x')} ({format_interval(pair['interval'])})"
                )
            else:
                cells.append("-")
        rows.append(cells)
    return _table(["category", *settings], rows)


def best_k_table(summary: dict[str, Any]) -> str:
    drafts = sorted({d for per in summary["best_k"].values() for d in per})
    if not drafts:
        return "(no speculative settings in this run)"
    rows = []
    for category in [*summary["categories"], OVERALL]:
        per = summary["best_k"].get(category, {})
        rows.append(
            [category]
            + [f"k={per[d]['k']}: {per[d]['speedup']:.2f}x" if d in per else "-" for d in drafts]
        )
    return _table(["category", *drafts], rows)


def memory_table(summary: dict[str, Any]) -> str:
    rows = [
        [r["setting"], _mb(r["peak_memory_bytes"]), _f(r["memory_overhead"], suffix="x")]
        for r in _rows(summary, OVERALL)
    ]
    return _table(["setting", "peak memory (MiB)", "vs target alone"], rows)


def divergence_table(summary: dict[str, Any]) -> str:
    if not summary["divergences"]:
        return "Every greedy output was identical to `ar`."
    rows = [
        [
            d["prompt_id"],
            str(d.get("turn", 0)),
            d["setting"],
            str(d["position"]),
            str(d["ar_token"]),
            str(d["spec_token"]),
            _f(d["top2_margin"], ".3f"),
        ]
        for d in summary["divergences"]
    ]
    header = ["prompt", "turn", "setting", "position", "ar token", "other token", "top-2 margin"]
    return _table(header, rows)


def _target(name: str | None) -> str:
    """The target as the report names it; a quantized one says it is the reference."""
    if name is None:
        return "`?`"
    bits = {"int8": "int8", "int4": "4-bit"}.get(name.rpartition(":")[2])
    if bits is None:
        return f"`{name}`"
    return f"`{name}` ({bits} weights: `ar` and the identity checks are this quantized model's)"


def _servers_line(summary: dict[str, Any], records: list[Record], info: dict) -> str:
    """What a `bench --server` run measured, in place of the engine's target line."""
    config = info.get("config", {})
    served = "; ".join(
        f"`{s['label']}` = {s['url']} (model `{s['model']}`, "
        + ("speculative counters read" if s["counters"] else "no speculative counters: speed only")
        + ")"
        for s in info["servers"]
    )
    machine = info.get("client_machine", {})
    return (
        f"Servers: {served}. Temperature {records[0].temperature}, up to "
        f"{config.get('max_new_tokens', '?')} new tokens, {len({r.prompt_id for r in records})} "
        f"prompts in {len(summary['categories'])} categories, {config.get('repeats', 1)} "
        f"repeat(s), each request alone on its server. Acceptance from each server's Prometheus "
        f"counters (differences around each request); the `ar` server (where one is labelled so) "
        f"is the baseline of speedups and of the identity checks, which compare texts. Client "
        f"machine: {machine.get('cpu', '?')}, {machine.get('cpus', '?')} CPUs."
    )


def _engine_line(summary: dict[str, Any], records: list[Record], info: dict) -> str:
    config = info.get("config", {})
    first = records[0]
    return (
        f"Target {_target(config.get('target') or first.target)}, {first.dtype}, linear layers on "
        f"{info.get('kernel', 'eager')}"
        + (f", attention {info['attention']}" if info.get("attention") else "")
        + ", temperature "
        f"{first.temperature}, up to {config.get('max_new_tokens', '?')} new tokens, "
        f"{len({r.prompt_id for r in records})} prompts in {len(summary['categories'])} "
        f"categories, {config.get('repeats', 1)} repeat(s). Machine: {info.get('machine', '?')}, "
        f"device {info.get('device', '?')}; versions {info.get('versions', {})}."
    )


def _steadiness_line(summary: dict[str, Any]) -> list[str]:
    """The machine's steadiness over the run (`aggregate.steadiness`), where it was timed."""
    held = summary.get("one_token_ms")  # absent from summaries saved before it
    if not held:
        return []
    return [
        f"The machine: the target alone's forward took {held['min']:.1f}-{held['max']:.1f} ms "
        f"(median {held['median']:.1f}) over its {held['records']} records; speedups pair "
        "settings prompt by prompt, but a slow stretch during one setting's turn moves that "
        "prompt's ratio (the intervals below include it).",
        "",
    ]


def render_markdown(summary: dict[str, Any], records: list[Record], info: dict) -> str:
    first = records[0]
    if info.get("servers"):
        head = _servers_line(summary, records, info)
    else:
        head = _engine_line(summary, records, info)
    lines = [
        "# Benchmark report",
        "",
        f"Command: `{info.get('command', '?')}`",
        "",
        head,
        "",
        "decode speedup = geometric mean over prompts of decode tokens/s (after the first block, "
        "prefill excluded) / the same prompt's `ar`; e2e speedup the same on whole-generation "
        "tokens/s (prefill included); the per-category and best-k tables show decode speedup. "
        "α = accepted / drafted, τ = tokens per target forward, c = draft forward / target "
        "forward, v(k) = verification forward / one-token forward (timed), ideal = "
        "(1 - α^(k+1)) / (1 - α) / (k·c + v(k)), efficiency = decode speedup / ideal. 95% "
        "interval: of the decode speedup, a bootstrap over prompts. A model-free "
        "drafter has c = 0 (its lookup is not a forward). vs hf-assisted / vs best HF: our decode "
        f"tokens/s over {summary.get('best_hf_assisted') or '-'} / "
        f"{summary.get('best_hf') or '-'} (HF's fastest settings in this run).",
        "",
        *_steadiness_line(summary),
        "## Overall",
        "",
        overall_table(summary),
        "",
        "## Speedup by category",
        "",
        category_table(summary),
        "",
        "## Against the fastest setting",
        "",
        "Each setting's decode tokens/s over that of the fastest setting of the category, prompt "
        "by prompt (geometric mean), with its 95% interval: a bootstrap over prompts, each "
        "prompt's repeats and turns drawn together (2000 draws, seeded). Paired on the same "
        "prompts, the prompts' own spread cancels; an interval that holds 1.00x means this run "
        "cannot tell the setting from the fastest. Few prompts make intervals too narrow, not "
        "too wide.",
        "",
        fastest_table(summary),
        "",
        "## Best k per category",
        "",
        best_k_table(summary),
        "",
        "## Memory",
        "",
        f"Memory source: {first.memory_source}.",
        "",
        memory_table(summary),
        "",
        "## Output identity (greedy)",
        "",
        divergence_table(summary),
        "",
        "## Plots",
        "",
    ]
    lines += [f"![{title}]({name})" for name, title in PLOTS.items()]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, summary: dict[str, Any], records: list[Record], info: dict) -> None:
    (out_dir / "report.md").write_text(render_markdown(summary, records, info))
    write_plots(out_dir, summary)


def write_plots(out_dir: Path, summary: dict[str, Any]) -> None:
    # slow import (matplotlib, ~0.5 s): only when plotting
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec_rows = [r for r in summary["rows"] if r["method"] == "spec"]
    chain_rows = [r for r in spec_rows if not r.get("tree")]  # k plots are about chains
    categories = summary["categories"]
    overall = [r for r in spec_rows if r["category"] == OVERALL]
    # acceptance plots: our settings and servers that export counters (bench --server)
    drafted_rows = [r for r in summary["rows"] if r.get("acceptance_rate") is not None]
    drafted_overall = [r for r in drafted_rows if r["category"] == OVERALL]

    # acceptance by category: one bar group per category, one bar per spec setting
    fig, ax = plt.subplots(figsize=(10, 4))
    shown = drafted_overall[:8]
    width = 0.8 / max(len(shown), 1)
    for i, setting in enumerate(shown):
        values = [
            _value(drafted_rows, setting["setting"], c, "acceptance_rate") for c in categories
        ]
        ax.bar(
            [x + i * width for x in range(len(categories))], values, width, label=setting["setting"]
        )
    _finish(ax, categories, "acceptance rate", len(shown))
    _save(fig, out_dir / "acceptance_by_category.png")

    # speedup vs k per category, one panel per draft (fixed k)
    drafts = list(
        dict.fromkeys(r["draft"] for r in overall if r["k_policy"] == "fixed" and not r.get("tree"))
    )
    fig, axes = plt.subplots(1, max(len(drafts), 1), figsize=(5 * max(len(drafts), 1), 4))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, draft in zip(axes, drafts, strict=False):
        for category in [*categories, OVERALL]:
            points = sorted(
                (r["k"], r["speedup"])
                for r in chain_rows
                if r["draft"] == draft
                and r["category"] == category
                and r["k_policy"] == "fixed"
                and r["speedup"] is not None
            )
            if points:
                style = "k-" if category == OVERALL else "-"
                ax.plot(*zip(*points, strict=True), style, marker="o", label=category)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(title=f"draft {draft}", xlabel="k", ylabel="decode speedup over ar")
        ax.legend(fontsize=7)
    _save(fig, out_dir / "speedup_vs_k.png")

    # per-position acceptance (overall)
    fig, ax = plt.subplots(figsize=(6, 4))
    with_positions = [r for r in drafted_overall if r.get("per_position_acceptance")]
    for r in with_positions:
        values = r["per_position_acceptance"]
        ax.plot(range(1, len(values) + 1), values, marker="o", label=r["setting"])
    ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05))
    if with_positions:
        ax.legend(fontsize=7)
    _save(fig, out_dir / "per_position_acceptance.png")

    # measured vs ideal
    fig, ax = plt.subplots(figsize=(5, 5))
    points = [r for r in spec_rows if r.get("ideal_speedup") and r["speedup"]]
    for category in [OVERALL, *categories]:
        xs = [r["ideal_speedup"] for r in points if r["category"] == category]
        ys = [r["speedup"] for r in points if r["category"] == category]
        if xs:
            ax.scatter(xs, ys, label=category, s=40 if category == OVERALL else 15)
    top = max([1.0] + [r["ideal_speedup"] for r in points] + [r["speedup"] for r in points])
    ax.plot([0, top * 1.05], [0, top * 1.05], color="grey", linewidth=0.8)
    ax.set(xlabel="ideal speedup (theory, measured α, c, v)", ylabel="measured decode speedup")
    if points:
        ax.legend(fontsize=7)
    _save(fig, out_dir / "measured_vs_ideal.png")


def _value(rows: list[dict[str, Any]], setting: str, category: str, field: str) -> float:
    for r in rows:
        if r["setting"] == setting and r["category"] == category:
            return r.get(field) or 0.0
    return 0.0


def _finish(ax: Any, categories: list[str], ylabel: str, n_series: int) -> None:
    ax.set_xticks([x + 0.4 - 0.4 / max(n_series, 1) for x in range(len(categories))])
    ax.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if n_series:
        ax.legend(fontsize=7)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt  # slow import: only when plotting

    plt.close(fig)
