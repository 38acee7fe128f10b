"""`specdecode bench-serve --compare DIR...`: saved load runs side by side (for instance our
server at two settings against llama.cpp's server) -> compare.md, compare.json and two plots.

Each run is a folder `bench-serve` wrote; it is named by its `--label` (the folder's name when
none was given). The report lists the settings that differ between the runs, since a comparison
is only as fair as its settings are equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specdecode.bench.serve_load import SUMMARY
from specdecode.bench.serve_report import (
    LEVEL_HEADER,
    latency_figure,
    level_cells,
    ms,
    rate,
    save,
    sec,
    table,
    throughput_figure,
    token_note,
)

COMPARE_JSON, COMPARE_MD = "compare.json", "compare.md"
THROUGHPUT_PLOT, LATENCY_PLOT = "compare_throughput.png", "compare_latency.png"
WIDE = (  # (title, metric, statistic, format)
    ("total tokens/s", "total_tokens_per_s", None, rate),
    ("p95 TTFT (ms)", "ttft_s", "p95", ms),
    ("p95 latency (s)", "latency_s", "p95", sec),
)


def load_summary(folder: str | Path) -> dict[str, Any]:
    """A run's summary.json, with a clear error for a folder that holds none."""
    path = Path(folder) / SUMMARY
    if not path.is_file():
        raise ValueError(
            f"{path} does not exist: run `specdecode bench-serve --out {folder}` first"
        )
    try:
        summary = json.loads(path.read_text())
    except (ValueError, OSError) as err:
        raise ValueError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("levels"), list):
        raise ValueError(f"{path}: not a bench-serve summary (no levels)")
    return summary


def labels(folders: list[Path], summaries: list[dict[str, Any]]) -> list[str]:
    """Each run's label, made unique with its folder's name where two runs share one."""
    names = [s.get("label") or f.name for f, s in zip(folders, summaries, strict=True)]
    unique = [
        f"{name} ({folder})" if names.count(name) > 1 else name
        for name, folder in zip(names, folders, strict=True)
    ]
    if len(set(unique)) != len(unique):
        raise ValueError(f"--compare: a folder is given twice ({', '.join(map(str, folders))})")
    return unique


def differences(summaries: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The settings (and route) whose values are not the same in every run."""
    keys = ["route", *dict.fromkeys(k for s in summaries for k in s["settings"])]
    values = {
        k: [s.get(k) if k == "route" else s["settings"].get(k) for s in summaries] for k in keys
    }
    return {k: v for k, v in values.items() if any(x != v[0] for x in v)}


def compare_runs(folders: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Write the side-by-side report of the runs in `folders` to `out`; returns compare.json."""
    if len(folders) < 2:
        raise ValueError("--compare needs two or more folders written by bench-serve")
    paths = [Path(f) for f in folders]
    summaries = [load_summary(p) for p in paths]
    names = labels(paths, summaries)
    result = {
        "runs": [
            {
                "label": name,
                "dir": str(path),
                "endpoint": s["endpoint"],
                "route": s["route"],
                "model": s["model"],
                "started": s["started"],
                "token_counting": s["token_counting"],
            }
            for name, path, s in zip(names, paths, summaries, strict=True)
        ],
        "differences": differences(summaries),
        "rows": [
            {"run": name, **{k: v for k, v in level.items() if k != "per_category"}}
            for name, s in zip(names, summaries, strict=True)
            for level in s["levels"]
        ],
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / COMPARE_JSON).write_text(json.dumps(result, indent=1))
    (out / COMPARE_MD).write_text(render_compare(names, summaries, result["differences"]))
    runs = list(zip(names, summaries, strict=True))
    save(throughput_figure(runs), out / THROUGHPUT_PLOT)
    save(latency_figure(runs), out / LATENCY_PLOT)
    return result


def wide_tables(names: list[str], summaries: list[dict[str, Any]]) -> list[str]:
    """One table per WIDE metric: a row per concurrency level, a column per run."""
    levels = sorted({lv["concurrency"] for s in summaries for lv in s["levels"]})
    by_level = [{lv["concurrency"]: lv for lv in s["levels"]} for s in summaries]
    lines: list[str] = []
    for title, metric, stat, fmt in WIDE:
        rows = []
        for c in levels:
            cells = [str(c)]
            for levels_of_run in by_level:
                level = levels_of_run.get(c)
                value = (
                    None
                    if level is None
                    else level[metric]
                    if stat is None
                    else level[metric][stat]
                )
                cells.append(fmt(value))
            rows.append(cells)
        lines += [f"### {title}", "", *table(["concurrency", *names], rows), ""]
    return lines


def main_table(names: list[str], summaries: list[dict[str, Any]]) -> str:
    """Every run's levels, grouped by concurrency."""
    rows = sorted(
        ((lv["concurrency"], i, lv) for i, s in enumerate(summaries) for lv in s["levels"]),
        key=lambda row: row[:2],
    )
    cells = [[str(c), names[i], *level_cells(lv)] for c, i, lv in rows]
    return "\n".join(table(["concurrency", "run", *LEVEL_HEADER[1:]], cells, text_columns=2))


def render_compare(
    names: list[str], summaries: list[dict[str, Any]], differ: dict[str, list[Any]]
) -> str:
    lines = ["# Serving load: side by side", "", "## Runs", ""]
    for name, s in zip(names, summaries, strict=True):
        lines.append(
            f"- **{name}**: {s['endpoint']}{s['route']}, model `{s['model']}`, started "
            f"{s['started']}; {token_note(s['token_counting'])}"
        )
    lines.append("")
    if differ:
        lines += ["Settings that differ between the runs:", ""]
        rows = [[k, *map(_show, v)] for k, v in differ.items()]
        lines += table(["setting", *names], rows, text_columns=len(names) + 1)
    else:
        lines.append("Every run used the same settings (prompts, tokens, temperature, levels).")
    lines += ["", "## By concurrency", "", *wide_tables(names, summaries)]
    lines += ["## Every level", "", main_table(names, summaries), "", "## Plots", ""]
    lines += [f"![throughput]({THROUGHPUT_PLOT})", f"![latency]({LATENCY_PLOT})"]
    return "\n".join(lines) + "\n"


def _show(value: Any) -> str:
    text = (
        "-"
        if value is None
        else ",".join(map(str, value))
        if isinstance(value, list)
        else str(value)
    )
    return text.replace("|", "\\|")
