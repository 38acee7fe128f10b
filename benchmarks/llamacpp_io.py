"""What benchmarks/vs_llamacpp.py sends to llama.cpp's tools and reads back, and its report.

Nothing here runs a model: the command lines, the parsers of the tools' own timing lines (the
formats of llama.cpp 0.5.0-dev, commit 0c1e570: `common_perf_print` of llama-completion, the
"encoded / decoded" lines of llama-speculative-simple, `llama-bench -o json`), the `--ours`
settings, the CPU's description and the summary and markdown of a results list. So the tests
check all of it on captured output (tests/data/llamacpp/) without llama.cpp.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.core import metrics

LLAMA = "llama.cpp"  # the method label of llama.cpp's target alone: the ratios' baseline
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-bench")
TARGET_FORMS = ("bf16", "int8", "int4")  # ours: the target's weights
DRAFT_FORMS = ("bf16", "int8", "int4")  # ours: the draft's weights
OURS_FORMS = "expected TARGET, TARGET+DRAFT:k=K or TARGET+DRAFT:tree=SHAPE (TARGET: bf16 or int4, DRAFT: bf16, int8 or int4)"
DEFAULT_OURS = (
    "bf16",
    "int4",
    "int4+int4:k=3",
    "int4+int4:tree=dynamic:5,6,2,0.3",
    "bf16+int4:tree=dynamic:5,6,2,0.3",  # the fastest lossless to the bfloat16 target
)

# --------------------------------------------------------------------------------------------
# Our settings


@dataclass(frozen=True)
class OursSpec:
    """One of our settings: the target's weights, and a draft's weights with a chain or a tree."""

    target: str  # "bf16" or "int4"
    draft: str | None = None  # None: the target alone; else "bf16", "int8" or "int4"
    k: int = 0  # a chain's k (0 with a tree or without a draft)
    tree: str | None = None  # a token-tree shape

    @classmethod
    def parse(cls, text: str) -> OursSpec:
        """`bf16`, `int4`, `int4+int4:k=3`, `bf16+int4:tree=dynamic:5,6,2,0.3`; ValueError
        saying what was given and what is expected."""
        target, plus, rest = text.strip().partition("+")
        if target not in TARGET_FORMS:
            raise ValueError(f"--ours {text!r}: target weights {target!r}; {OURS_FORMS}")
        if not plus:
            return cls(target)
        draft, _, option = rest.partition(":")
        if draft not in DRAFT_FORMS:
            raise ValueError(f"--ours {text!r}: draft weights {draft!r}; {OURS_FORMS}")
        key, _, value = option.partition("=")
        if key == "k" and value.isdigit() and int(value) >= 1:
            return cls(target, draft, k=int(value))
        if key == "tree" and value:
            return cls(target, draft, tree=value)
        raise ValueError(
            f"--ours {text!r}: after the draft, k=K (K >= 1) or tree=SHAPE; {OURS_FORMS}"
        )

    @property
    def speculative(self) -> bool:
        return self.draft is not None

    @property
    def label(self) -> str:
        if self.draft is None:
            return f"ours {self.target}"
        drafting = f"k={self.k}" if self.tree is None else f"tree {self.tree}"
        return f"ours {self.target} + {self.draft} draft {drafting}"

    @property
    def baseline(self) -> str:
        """The label of the same target alone: this setting's greedy reference."""
        return f"ours {self.target}"


def spec_label(draft_max: int) -> str:
    """The method label of llama-speculative-simple at `--spec-draft-n-max draft_max`."""
    return f"{LLAMA} spec draft-max={draft_max}"


# --------------------------------------------------------------------------------------------
# Command lines


def completion_command(
    bin_dir: Path, gguf: Path, prompt: str, n: int, threads: int, ctx: int
) -> list[str]:
    """llama-completion on the prompt text as it is (already chat-formatted: no conversation
    mode, no escape processing), greedy, `n` new tokens at most, the prompt's ids logged."""
    return [
        str(bin_dir / "llama-completion"),
        *("-m", str(gguf), "-p", prompt, "--no-escape", "-no-cnv", "--no-display-prompt"),
        *("-n", str(n), "--temp", "0", "--seed", "0", "-t", str(threads), "-c", str(ctx)),
        "--verbose-prompt",  # the prompt's token ids, to check both sides feed the same ones
    ]


def speculative_command(
    bin_dir: Path,
    gguf: Path,
    draft_gguf: Path,
    prompt: str,
    n: int,
    threads: int,
    ctx: int,
    draft_max: int,
) -> list[str]:
    """llama-speculative-simple with a draft model drafting up to `draft_max` tokens, greedy.

    (This llama.cpp names `--draft-max` `--spec-draft-n-max` and needs `--spec-type`.)"""
    return [
        str(bin_dir / "llama-speculative-simple"),
        *("-m", str(gguf), "-md", str(draft_gguf), "-p", prompt, "--no-escape"),
        *("-n", str(n), "--temp", "0", "--seed", "0", "-t", str(threads), "-c", str(ctx)),
        *("--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max)),
    ]


def bench_command(bin_dir: Path, gguf: Path, n: int, threads: int, repetitions: int) -> list[str]:
    """llama-bench's text generation test alone (tg`n`: no prompt), JSON out."""
    return [
        str(bin_dir / "llama-bench"),
        *("-m", str(gguf), "-p", "0", "-n", str(n), "-t", str(threads)),
        *("-r", str(repetitions), "-o", "json"),
    ]


# --------------------------------------------------------------------------------------------
# Parsing the tools' output

_NUMBER = r"([0-9]+(?:\.[0-9]+)?|inf|nan)"
_PERF = re.compile(
    r"common_perf_print:\s+(prompt eval|eval|total) time =\s+" + _NUMBER + r" ms /\s+(\d+) "
)
_PROMPT_COUNT = re.compile(r"number of tokens in prompt = (\d+)")
# one line of --verbose-prompt: "<log prefix>   9690 -> 'system'" (a piece may span lines)
_PROMPT_ID = re.compile(r"^(?:[0-9.]+ [A-Z] )?\s*(\d+) -> '")
_SPEC = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+" + _NUMBER + r" seconds")
_SPEC_COUNTS = re.compile(r"\b(n_drafted|n_accept|n_predict)\s+= (\d+)")
_VERSION = re.compile(r"version: (\S+) \(build (\d+), commit (\w+)\)")


@dataclass
class LlamaRun:
    """One llama.cpp generation, from its own timing lines (times in seconds)."""

    prompt_tokens: int  # as llama.cpp tokenized the prompt
    new_tokens: int
    prefill_s: float  # the prompt's evaluation (speculative: the target's and the draft's)
    decode_s: float  # the generation after it
    total_s: float  # the whole generation, prefill included
    decode_tokens: int  # the tokens `decode_s` produced
    prompt_ids: list[int] | None = None  # llama-completion --verbose-prompt only
    drafted: int | None = None  # llama-speculative-simple only
    accepted: int | None = None
    text: str = ""

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return _rate(self.prompt_tokens, self.prefill_s)

    @property
    def decode_tokens_per_s(self) -> float | None:
        return _rate(self.decode_tokens, self.decode_s)

    @property
    def tokens_per_s(self) -> float | None:
        return _rate(self.new_tokens, self.total_s)


def _rate(count: int, seconds: float) -> float | None:
    return count / seconds if count > 0 and seconds > 0 and math.isfinite(seconds) else None


def parse_completion(stderr: str, stdout: str = "") -> LlamaRun:
    """llama-completion's `common_perf_print` lines: "prompt eval time = X ms / P tokens",
    "eval time = Y ms / R runs", "total time = Z ms / T tokens". The first new token comes from
    the prompt's evaluation, each of the R runs gives one more: R + 1 new tokens, R of them in
    the decode time. ValueError naming what is missing."""
    found: dict[str, tuple[float, int]] = {}
    for match in _PERF.finditer(stderr):
        found[match.group(1)] = (float(match.group(2)) / 1000, int(match.group(3)))
    missing = [k for k in ("prompt eval", "eval", "total") if k not in found]
    if missing:
        raise ValueError(
            f"llama-completion printed no {' / '.join(missing)} time line "
            f"(expected 'common_perf_print: ... time = X ms / N tokens'); its stderr ends: "
            f"{_tail(stderr)}"
        )
    (prefill_s, prompt_tokens), (decode_s, runs), (total_s, _) = (
        found["prompt eval"],
        found["eval"],
        found["total"],
    )
    text = stdout.removesuffix("\n").removesuffix(" [end of text]")
    return LlamaRun(
        prompt_tokens, runs + 1, prefill_s, decode_s, total_s, runs, prompt_ids(stderr), text=text
    )


def prompt_ids(stderr: str) -> list[int] | None:
    """The prompt's token ids from `--verbose-prompt` (None when it printed them not all)."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        count = _PROMPT_COUNT.search(line)
        if count is None:
            continue
        ids = [int(m.group(1)) for m in map(_PROMPT_ID.match, lines[i + 1 :]) if m]
        n = int(count.group(1))
        return ids[:n] if len(ids) >= n else None
    return None


def parse_speculative(stderr: str, stdout: str = "", prompt: str = "") -> LlamaRun:
    """llama-speculative-simple's "encoded N tokens in S seconds" (the prompt, on the target and
    the draft) and "decoded M tokens in T seconds" (every new token, the first step's
    included), and its n_drafted / n_accept counts. It echoes `prompt`, then the new text."""
    times = {m.group(1): (int(m.group(2)), float(m.group(3))) for m in _SPEC.finditer(stderr)}
    missing = [k for k in ("encoded", "decoded") if k not in times]
    if missing:
        raise ValueError(
            f"llama-speculative-simple printed no {' / '.join(missing)} line "
            f"(expected '{missing[0]} N tokens in S seconds'); its stderr ends: {_tail(stderr)}"
        )
    counts = {m.group(1): int(m.group(2)) for m in _SPEC_COUNTS.finditer(stderr)}
    (prompt_tokens, prefill_s), (new, decode_s) = times["encoded"], times["decoded"]
    text = stdout.lstrip("\n")
    text = text[len(prompt) :] if prompt and text.startswith(prompt) else text
    return LlamaRun(
        prompt_tokens,
        new,
        prefill_s,
        decode_s,
        prefill_s + decode_s,
        new,
        drafted=counts.get("n_drafted"),
        accepted=counts.get("n_accept"),
        text=text.rstrip("\n"),
    )


def parse_bench(stdout: str) -> dict[str, Any]:
    """`llama-bench -o json`'s one test: tokens/s (mean, standard deviation), its build, the
    CPU it names."""
    try:
        tests = json.loads(stdout)
        test = tests[0]
        return {
            "test": f"tg{test['n_gen']}" if not test.get("n_prompt") else f"pp{test['n_prompt']}",
            "tokens_per_s": float(test["avg_ts"]),
            "stddev_tokens_per_s": float(test["stddev_ts"]),
            "repetitions": len(test.get("samples_ts", [])),
            "threads": test.get("n_threads"),
            "model_type": test.get("model_type"),
            "build_commit": test.get("build_commit"),
            "cpu_info": test.get("cpu_info"),
        }
    except (ValueError, LookupError, TypeError) as err:
        raise ValueError(
            f"llama-bench -o json gave no test result ({err}): {_tail(stdout)}"
        ) from err


def parse_version(text: str) -> dict[str, str]:
    """`llama-completion --version`: "version: 0.5.0-dev (build 1, commit 0c1e570)"."""
    match = _VERSION.search(text)
    if match is None:
        return {"version": text.strip().splitlines()[0] if text.strip() else "unknown"}
    return {"version": match.group(1), "build": match.group(2), "commit": match.group(3)}


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "(nothing)"


# --------------------------------------------------------------------------------------------
# The machine

_FLAGS = re.compile(r"^(avx2|fma|avx512\w*|\w*vnni\w*|amx\w*)$")


def run_tool(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run one tool (a llama.cpp binary, or a Python script); RuntimeError with the end of its
    stderr when it fails or runs past `timeout` seconds."""
    name = Path(command[1] if command[0] == sys.executable else command[0]).name
    try:
        proc = subprocess.run(
            command, capture_output=True, text=True, errors="replace", timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{name} ran past {timeout:.0f} s") from err
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"{name} failed (exit {proc.returncode}): {tail}")
    return proc


def machine(threads: int) -> dict[str, Any]:
    """The CPU (from /proc/cpuinfo), the threads and the library versions of a run."""
    import platform

    import torch
    import transformers

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    cpu = describe_cpu(cpuinfo)
    if cpu["model_name"] == "unknown":
        cpu["model_name"] = platform.processor() or platform.machine()
    return {
        "cpu": cpu,
        "threads": threads,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def describe_cpu(cpuinfo: str) -> dict[str, Any]:
    """The first processor of /proc/cpuinfo's text: model name, family, model and the flags
    that decide the kernels (AVX2, FMA, AVX-512*, VNNI, AMX)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = sorted(f for f in fields.get("flags", "").split() if _FLAGS.match(f))
    return {
        "model_name": fields.get("model name", "unknown"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "flags": flags,
        "logical_cpus": sum(line.startswith("processor") for line in cpuinfo.splitlines()),
    }


# --------------------------------------------------------------------------------------------
# Summary and report


def geometric_mean(values: Iterable[float | None]) -> float | None:
    """specdecode's geometric mean over the values that were measured (None and 0 left out)."""
    return metrics.geometric_mean([v for v in values if v])


def summarize(runs: list[dict[str, Any]], methods: Sequence[str]) -> list[dict[str, Any]]:
    """One row per method: decode and e2e tokens/s per category and overall (geometric means
    over prompts), prefill tokens/s, the paired ratios to llama.cpp's target alone (geometric
    mean over prompts of the per-prompt ratio), greedy identity and τ."""
    categories = list(dict.fromkeys(r["category"] for r in runs))
    base = {r["prompt_id"]: r for r in runs if r["method"] == LLAMA}
    rows = []
    for method in methods:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        identity = [
            r["identical_to_target"] for r in mine if r.get("identical_to_target") is not None
        ]
        taus = [r["mean_acceptance_length"] for r in mine if r.get("mean_acceptance_length")]
        rows.append(
            {
                "method": method,
                "prompts": len(mine),
                "decode_by_category": _by_category(mine, categories, "decode_tokens_per_s"),
                "e2e_by_category": _by_category(mine, categories, "tokens_per_s"),
                "decode_tokens_per_s": geometric_mean(r["decode_tokens_per_s"] for r in mine),
                "tokens_per_s": geometric_mean(r["tokens_per_s"] for r in mine),
                "prefill_tokens_per_s": geometric_mean(r["prefill_tokens_per_s"] for r in mine),
                "decode_vs_llama": _paired(mine, base, "decode_tokens_per_s"),
                "e2e_vs_llama": _paired(mine, base, "tokens_per_s"),
                "identical": f"{sum(identity)}/{len(identity)}" if identity else None,
                "mean_acceptance_length": sum(taus) / len(taus) if taus else None,
                "new_tokens": sum(r["new_tokens"] for r in mine) / len(mine),
            }
        )
    return rows


def _by_category(
    mine: list[dict[str, Any]], categories: list[str], key: str
) -> dict[str, float | None]:
    return {c: geometric_mean(r[key] for r in mine if r["category"] == c) for c in categories}


def _paired(mine: list[dict[str, Any]], base: dict[str, dict[str, Any]], key: str) -> float | None:
    ratios = []
    for run in mine:
        other = base.get(run["prompt_id"], {}).get(key)
        if run.get(key) and other:
            ratios.append(run[key] / other)
    return geometric_mean(ratios)


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render_report(results: dict[str, Any]) -> str:
    """report.md from results.json's content: the setup, the prompt check, decode tokens/s per
    category, and last the main table (what the script prints last)."""
    config, machine, llama = results["config"], results["machine"], results["llama_cpp"]
    runs, rows = results["runs"], summarize(results["runs"], results["methods"])
    cpu = machine["cpu"]
    lines = [
        "# specdecode vs llama.cpp",
        "",
        f"Command: `{config['command']}`  ",
        f"Started {results['started']}.",
        "",
        f"- CPU: {cpu['model_name']} (family {cpu['family']}, model {cpu['model']}), "
        f"{machine['threads']} threads for both sides; flags: {', '.join(cpu['flags']) or 'none of AVX2/AVX-512/VNNI/AMX'}",
        f"- llama.cpp {llama.get('version', '?')} (build {llama.get('build', '?')}, commit "
        f"{llama.get('commit', '?')}), tools in `{config['llama_bin']}`",
        f"- software: {', '.join(f'{k} {v}' for k, v in machine['versions'].items())}",
        f"- target `{config['target']}` (llama.cpp: `{Path(config['target_gguf']).name}`; ours: "
        "converted to bfloat16, `int4`: our 4-bit weights of it), draft "
        f"`{config['draft']}` (llama.cpp: `{Path(config['draft_gguf']).name}`"
        + (
            f"; ours: its output layer on the first {config['draft_vocab']} ids and the special "
            "ones, the draft vocabulary"
            if config.get("draft_vocab")
            else ""
        )
        + ")",
        f"- prompts: {len({r['prompt_id'] for r in runs})} of the built-in suite "
        f"({', '.join(config['categories'])}; at most {config['limit']} per category), chat "
        f"template applied by ours and given to llama.cpp as text; greedy, at most "
        f"{config['max_new_tokens']} new tokens, stopping at EOS; the order of the methods "
        "rotated per prompt",
        "",
        "Decode tokens/s: the tokens after the first over the time after it (prefill apart); "
        "llama.cpp's target alone: its `eval time` line; llama.cpp's speculative decoding: its "
        "`decoded N tokens in S seconds` (the first step included; it may run a few tokens past "
        "the limit). e2e: new tokens over the whole generation, prefill included. Each a "
        "geometric mean over prompts; ratios are paired per prompt against llama.cpp's target "
        "alone. Identical: greedy output token for token equal to our same target alone "
        "(llama.cpp speculative: its text a prefix of llama.cpp's target alone or the reverse).",
        "",
    ]
    bench = results.get("llama_bench")
    if bench:
        lines += [
            f"llama-bench {bench['test']} (the tool's own number, {bench['repetitions']} "
            f"repetitions, {bench['threads']} threads): {_num(bench['tokens_per_s'])} ± "
            f"{_num(bench['stddev_tokens_per_s'])} tokens/s.",
            "",
        ]
    lines += [*_prompt_check(runs), ""]
    categories = list(dict.fromkeys(r["category"] for r in runs))
    for title, key, overall in (
        ("Decode tokens/s per category", "decode_by_category", "decode_tokens_per_s"),
        ("e2e tokens/s per category (prefill included)", "e2e_by_category", "tokens_per_s"),
    ):
        lines += [
            f"## {title}",
            "",
            "| method | " + " | ".join(categories) + " | geomean |",
            "|---|" + "---:|" * (len(categories) + 1),
        ]
        for row in rows:
            cells = [_num(row[key][c]) for c in categories]
            lines.append(f"| {row['method']} | " + " | ".join(cells) + f" | {_num(row[overall])} |")
        lines.append("")
    lines += [*_divergences(runs), "## Summary", "", main_table(rows)]
    return "\n".join(lines) + "\n"


def main_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of `summarize`'s rows."""
    lines = [
        "| method | decode tok/s | e2e tok/s | prefill tok/s | decode vs llama.cpp | "
        "e2e vs llama.cpp | identical | τ | new tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | {_num(row['decode_tokens_per_s'])} | "
            f"{_num(row['tokens_per_s'])} | {_num(row['prefill_tokens_per_s'], 1)} | "
            f"{_ratio(row['decode_vs_llama'])} | {_ratio(row['e2e_vs_llama'])} | "
            f"{row['identical'] or '-'} | {_num(row['mean_acceptance_length'])} | "
            f"{_num(row['new_tokens'], 1)} |"
        )
    return "\n".join(lines)


def _prompt_check(runs: list[dict[str, Any]]) -> list[str]:
    """Whether llama.cpp fed the same prompt tokens as ours (ids where it logs them)."""
    checked = [r for r in runs if r.get("prompt_match") is not None]
    bad = [r for r in checked if not r["prompt_match"]]
    if not checked:
        return ["Prompt tokens: not checked."]
    if not bad:
        return [
            f"Prompt tokens: llama.cpp fed the same prompt tokens as ours in all {len(checked)} runs."
        ]
    lines = [f"**Prompt tokens differ** in {len(bad)} of {len(checked)} llama.cpp runs:"]
    lines += [
        f"- {r['prompt_id']} ({r['method']}): llama.cpp {r['tool_prompt_tokens']} tokens, "
        f"ours {r['prompt_tokens']}"
        for r in bad
    ]
    return lines


def _divergences(runs: list[dict[str, Any]]) -> list[str]:
    """Each greedy output that is not its target's own, where and at which top-2 margin."""
    lines = []
    for run in runs:
        if run.get("identical_to_target") is not False:
            continue
        where = run.get("first_divergence")
        if where is None:
            lines.append(f"- {run['prompt_id']}, {run['method']}: its text differs")
        else:
            margin = where.get("top2_margin")
            lines.append(
                f"- {run['prompt_id']}, {run['method']}: from token {where['position']} "
                f"(target's top-2 margin there: {_num(margin, 3)})"
            )
    if not lines:
        return []
    return ["## Greedy divergences", "", *lines, ""]
