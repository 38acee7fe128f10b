"""A serving load run's summary.json -> report.md and two plots (throughput, p95 latency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

THROUGHPUT_PLOT, LATENCY_PLOT = "throughput.png", "latency.png"
LEVEL_HEADER = (
    "concurrency",
    "requests",
    "errors",
    "429",
    "total tok/s",
    "p50 TTFT ms",
    "p95 TTFT ms",
    "p95 ITL ms",
    "p50 TPOT ms",
    "p95 latency s",
)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def sec(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def level_cells(level: dict[str, Any]) -> list[str]:
    """One row of LEVEL_HEADER (a level, or a category within it, after the first column)."""
    return [
        str(level["requests"]),
        str(level["errors"]),
        str(level["rate_limited"]),
        rate(level["total_tokens_per_s"]),
        ms(level["ttft_s"]["p50"]),
        ms(level["ttft_s"]["p95"]),
        ms(level["itl_s"]["p95"]),
        ms(level["tpot_s"]["p50"]),
        sec(level["latency_s"]["p95"]),
    ]


def table(
    header: tuple[str, ...] | list[str], rows: list[list[str]], text_columns: int = 1
) -> list[str]:
    """A markdown table, the first `text_columns` left-aligned, the numbers right-aligned."""
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def token_note(counting: dict[str, int]) -> str:
    usage, chunks = counting.get("usage", 0), counting.get("chunks", 0)
    if chunks == 0:
        return "tokens: the server's `usage` count"
    if usage == 0:
        return "tokens: content chunks counted (the server sent no `usage`)"
    return f"tokens: the server's `usage` for {usage} requests, content chunks for {chunks}"


def main_table(summary: dict[str, Any]) -> str:
    rows = [[str(level["concurrency"]), *level_cells(level)] for level in summary["levels"]]
    return "\n".join(table(LEVEL_HEADER, rows))


def render_report(summary: dict[str, Any]) -> str:
    settings = summary["settings"]
    amount = (
        f"{settings['requests_per_level']} requests per level"
        if settings["requests_per_level"] is not None
        else f"{settings['duration_s']:g} s per level"
        if settings["duration_s"] is not None
        else "max(16, 4 x concurrency) requests per level"
    )
    machine = summary["client_machine"]
    lines = [
        f"# Serving load: {summary['label']}",
        "",
        f"- endpoint: {summary['endpoint']}{summary['route']}, model `{summary['model']}`",
        f"- {amount}, up to {settings['max_new_tokens']} new tokens, temperature "
        f"{settings['temperature']:g}, prompts: {settings['prompts_file'] or 'the built-in suite'}"
        + (f" ({', '.join(settings['categories'])})" if settings["categories"] else "")
        + (
            ", each level after the last one's prompts"
            if settings.get("prompt_order") == "continue"
            else ""
        ),
        f"- started {summary['started']}; client: {machine['cpu']}, {machine['cpus']} CPUs",
        f"- {token_note(summary['token_counting'])}; ITL: gaps between content chunks (a chunk "
        "may carry several tokens); TPOT: time after the first chunk / (tokens - 1)",
        "- total tok/s: completion tokens of successful requests / the level's wall time; "
        "errors: failed requests other than 429",
    ]
    if summary.get("command"):
        lines += ["", "```", summary["command"], "```"]
    lines += ["", "## Per level", "", main_table(summary), "", "## Per category", ""]
    header = ["concurrency", "category", *LEVEL_HEADER[1:]]
    rows = [
        [str(level["concurrency"]), category, *level_cells(stats)]
        for level in summary["levels"]
        for category, stats in level["per_category"].items()
    ]
    lines += table(header, rows, text_columns=2)
    lines += [
        "",
        "## Plots",
        "",
        f"![throughput]({THROUGHPUT_PLOT})",
        f"![latency]({LATENCY_PLOT})",
    ]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, summary: dict[str, Any]) -> None:
    (out_dir / "report.md").write_text(render_report(summary))
    runs = [(summary["label"], summary)]
    save(throughput_figure(runs), out_dir / THROUGHPUT_PLOT)
    save(latency_figure(runs), out_dir / LATENCY_PLOT)


def series(summary: dict[str, Any], metric: str, stat: str | None = None) -> tuple[list, list]:
    """(concurrency levels, values) of one metric, levels without a value left out."""
    points = []
    for level in summary["levels"]:
        value = level[metric] if stat is None else level[metric][stat]
        if value is not None:
            points.append((level["concurrency"], value))
    points.sort()
    return [c for c, _ in points], [v for _, v in points]


def throughput_figure(runs: list[tuple[str, dict[str, Any]]]) -> Any:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, summary in runs:
        ax.plot(*series(summary, "total_tokens_per_s"), marker="o", label=label)
    _concurrency_axis(ax, runs)
    ax.set(ylabel="total tokens/s (completion)", title="throughput vs concurrency")
    _from_zero(ax)
    ax.legend(fontsize=8)
    return fig


def latency_figure(runs: list[tuple[str, dict[str, Any]]]) -> Any:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, summary) in enumerate(runs):
        color = f"C{i % 10}"
        ax.plot(*series(summary, "latency_s", "p95"), "-o", color=color, label=f"{label}: total")
        ax.plot(*series(summary, "ttft_s", "p95"), "--s", color=color, label=f"{label}: TTFT")
    _concurrency_axis(ax, runs)
    ax.set(ylabel="p95 latency (s)", title="p95 latency vs concurrency")
    _from_zero(ax)
    ax.legend(fontsize=8)
    return fig


def _from_zero(ax: Any) -> None:
    """The y axis from 0 to a tenth above the highest point."""
    top = max((max(line.get_ydata(), default=0) for line in ax.get_lines()), default=0)
    ax.set_ylim(0, top * 1.1 or 1)


def _concurrency_axis(ax: Any, runs: list[tuple[str, dict[str, Any]]]) -> None:
    levels = sorted({lv["concurrency"] for _, s in runs for lv in s["levels"]})
    if levels and levels[-1] / levels[0] >= 4:
        ax.set_xscale("log", base=2)
        from matplotlib.ticker import NullLocator  # slow import: only when plotting

        ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(levels)
    ax.set_xticklabels([str(c) for c in levels])
    ax.set_xlabel("concurrent clients")
    ax.grid(True, alpha=0.3)


def _pyplot() -> Any:
    # slow import (matplotlib, ~0.5 s): only when plotting
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
