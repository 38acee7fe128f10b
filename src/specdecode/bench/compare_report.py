"""compare.json -> report.md and quality_vs_speed.png (reads only the saved result)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdecode.bench.report import format_interval

PLOT = "quality_vs_speed.png"


def _f(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _mib(n_bytes: Any) -> str:
    if not n_bytes:
        return "-"
    mib = n_bytes / 2**20
    return f"{mib:,.0f}" if mib >= 100 else f"{mib:.2g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (speedup, KL divergence) no other point beats: none is at least
    as fast and at most as far from the reference while better in one of the two."""
    front = []
    for i, (speed, kld) in enumerate(points):
        dominated = any(
            s >= speed and d <= kld and (s > speed or d < kld)
            for j, (s, d) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return front


def _plottable(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The techniques to plot: every row but the sampled baseline (the reference alone again)."""
    return [
        r
        for r in result["rows"]
        if r["decode_speedup"] is not None
        and r["kld_mean"] is not None
        and (r["speculative"] or not r["temperature"])
    ]


def write_plot(out_dir: Path, result: dict[str, Any]) -> bool:
    """One point per technique (decode speedup, mean KL divergence), the Pareto front joined."""
    rows = _plottable(result)
    if not rows:
        return False
    # slow import (matplotlib, ~0.5 s): only when plotting
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["decode_speedup"], r["kld_mean"]) for r in rows]
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, (row, (x, y)) in enumerate(zip(rows, points, strict=True)):
        on_front = i in front
        marker = "s" if row["speculative"] else "o"
        ax.scatter(
            x,
            y,
            marker=marker,
            s=70 if on_front else 35,
            zorder=3,
            color="tab:red" if on_front else "tab:blue",
        )
        ax.annotate(row["label"], (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if len(front) > 1:
        line = sorted(points[i] for i in front)
        ax.plot(
            [p[0] for p in line],
            [p[1] for p in line],
            color="tab:red",
            lw=1,
            zorder=2,
            label="Pareto front",
        )
        ax.legend(loc="best", fontsize=8)
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel(f"decode speedup over {result['reference']} alone (paired geometric mean)")
    ax.set_ylabel(f"KL divergence to {result['reference']} (mean, nats per token)")
    ax.set_title("quality vs speed: squares speculative, red on the Pareto front")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / PLOT, dpi=120)
    plt.close(fig)
    return True


def main_table(result: dict[str, Any]) -> str:
    header = [
        "technique",
        "lossless to",
        "KL mean",
        "KL p99",
        "top-1",
        "PPL",
        "tasks",
        "decode speedup",
        "95% interval",
        "e2e speedup",
        "tokens/s",
        "memory MiB",
        "identical",
    ]
    rows = []
    for r in result["rows"]:
        identical = "-" if r["compared"] is None else f"{r['identical']}/{r['compared']}"
        rows.append(
            [
                r["technique"],
                r["lossless_to"],
                _f(r["kld_mean"], ".4f"),
                _f(r["kld_p99"], ".3f"),
                _f(r["top1_agreement"], ".3f"),
                _f(r["perplexity"], ".3f"),
                _f(r["task_pass_rate"], ".2f"),
                _f(r["decode_speedup"]),
                format_interval(r.get("decode_speedup_interval"), ""),  # absent from older results
                _f(r["e2e_speedup"]),
                _f(r["tokens_per_s"], ".1f"),
                _mib(r["memory_bytes"]),
                identical,
            ]
        )
    return _table(header, rows)


def _category_table(result: dict[str, Any]) -> str:
    quality = result["quality"]
    categories = list(dict.fromkeys(c for q in quality.values() for c in q if c != "all"))
    header = ["variant", *categories]
    rows = [
        [
            name,
            *(
                f"{_f(q.get(c, {}).get('kld_mean'), '.4f')} / "
                f"{_f(q.get(c, {}).get('top1_agreement'), '.2f')}"
                for c in categories
            ),
        ]
        for name, q in quality.items()
    ]
    return _table(header, rows)


def _task_table(result: dict[str, Any]) -> str:
    rows = []
    for name, entry in result["tasks"].items():
        rates = entry["rates"]
        cells = [
            f"{rates[k]['passed']}/{rates[k]['total']}" if k in rates else "-"
            for k in ("code", "math", "all")
        ]
        rows.append([name, *cells])
    return _table(["variant", "code", "math", "all"], rows)


def _variant_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, info in result["variants"].items():
        parts = [f"{info.get('params', 0):,} parameters", f"{info.get('layers')} layers"]
        parts.append(f"MLP width {info.get('intermediate_size')}")
        if "dropped_layers" in info:
            parts.append(f"dropped layers {info['dropped_layers']} (lowest block influence)")
        if "removed_fraction" in info:
            parts.append(
                f"MLP channels {info['original_intermediate_size']} -> "
                f"{info['intermediate_size']} ({info['removed_fraction']:.1%} removed)"
            )
        parts.append(f"linears on {info.get('kernel')}")
        lines.append(f"- **{name}**: " + ", ".join(parts))
    return lines


def render(result: dict[str, Any], plotted: bool) -> str:
    ref = result["reference"]
    config = result["config"]
    preset = (
        f"This run's target, `{result['target']}`, is one of our presets."
        if result["target_is_preset"]
        else f"This run's target, `{result['target']}`, is not one of our presets: its loss "
        "below is the real one, provided it was loaded from its original weights."
    )
    calibration = result.get("calibration", {})
    lines = [
        "# Speculation vs quantization vs pruning",
        "",
        f"`{result['command'] or 'specdecode compare'}`",
        "",
        f"{result['date']}; {result['machine']}; target `{result['target']}` "
        f"({ref}, {result['device']}, linears on {result['kernel']}), draft "
        f"`{result['draft']}`; {config['max_new_tokens']} new tokens per prompt; "
        f"torch {result['versions']['torch']}, transformers {result['versions']['transformers']}.",
        "",
        "**What the reference is.** Quality is measured against the target in "
        f"{ref} on the same text. On our presets the bfloat16 reference is itself the GGUF "
        "Q4_K_M file (Q4_1 for smollm2-135m-instruct) dequantized, so int4 on groups of 32 is "
        "nearly free there: it is close to the very weights the reference was made from. On "
        "your own bfloat16 model (a hub id or a folder) the same command measures the real "
        f"loss. {preset}",
        "",
        main_table(result),
        "",
        "- A speculative row reproduces the target it names (`lossless to`): its quality "
        "columns are that target's, and greedy it was checked token for token against that "
        "target alone on every timed prompt (`identical`; in bfloat16 a mismatch is allowed "
        "only at a near-tie, docs/architecture.md invariant 1). Tasks run greedy, so the "
        "sampled rows have none.",
        f"- KL mean / p99, top-1 and PPL: over the {ref} target's own greedy answers to the "
        "scored bench prompts, teacher-forced (KL(p_ref || p_variant) of the raw next-token "
        "distributions in nats per token, top-1 agreement, perplexity of the answers), as "
        "llama.cpp's `llama-perplexity --kl-divergence` reports them.",
        f"- Speedups: paired geometric means over prompts of decode tokens/s (prefill "
        f"excluded) and whole-generation tokens/s, against {ref} alone (the sampled rows "
        f"against {ref} sampled at the same temperature), measured interleaved in one run. "
        "tokens/s: the mean whole-generation rate. Memory: weights held + key/value caches, "
        "computed.",
    ]
    if any(info.get("kernel", "").startswith("int") for info in result["variants"].values()):
        lines.append(
            "- The int8 / int4 rows hold their quantized weights only (as `MODEL:int4` / "
            "`MODEL:int8` targets do): the bfloat16 weights of their quantized linears are not "
            "counted, an output layer tied to the embedding and the embedding are."
        )
    divergences = result.get("divergences", [])
    if divergences:
        where = "; ".join(
            f"{d['variant']} {d['prompt_id']} at token {d['position']} (margin "
            f"{_f(d['top2_margin'], '.3g')})"
            for d in divergences
        )
        lines.append(
            f"- Greedy speculative outputs unlike their target's: {len(divergences)}, each "
            f"with the target's top-1 minus top-2 logit where it diverged: {where}."
        )
    if plotted:
        lines += ["", f"![quality vs speed]({PLOT})"]
    lines += ["", "## Quality per category (KL mean / top-1 agreement)", ""]
    lines += [_category_table(result)]
    if result["tasks"]:
        lines += ["", "## Task pass rates (greedy, each variant alone)", "", _task_table(result)]
    lines += ["", "## The variants", "", *_variant_lines(result)]
    if calibration.get("tokens"):
        lines += [
            "",
            f"Pruning chose from calibration text: the target's greedy answers to "
            f"{len(calibration['prompts'])} bench prompts that are never scored "
            f"({', '.join(calibration['prompts'])}), {calibration['tokens']} tokens with the "
            "prompts.",
        ]
    lines += [
        "",
        "Every measured setting is in compare.json (`settings`); each run in results.jsonl.",
    ]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, result: dict[str, Any]) -> None:
    plotted = write_plot(out_dir, result)
    (out_dir / "report.md").write_text(render(result, plotted))
