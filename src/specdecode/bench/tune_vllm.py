"""`specdecode tune --engine vllm`: measure vLLM's speculative settings, and ours inside vLLM.

Every candidate is a vLLM server started from the user's vLLM environment (vllm_server.py) with
one `speculative_config`, measured by `bench --server` on the user's prompts (one category at a
time, acceptance from vLLM's counters) and stopped before the next starts, so each has the
machine alone. The candidates, per `--draft` and per k of `ks`:

- `ar`: vLLM without speculation, the baseline of every speedup and identity check;
- a model: vLLM's `draft_model` method; `ngram:MIN-MAX`: vLLM's `ngram` method and our
  `NgramProposer` (its `custom_class` method); `suffix[:OPTIONS]`: our `SuffixProposer`
  (vLLM's own `suffix` method needs Arctic Inference, which its CPU build lacks);
- other drafts (early exit, distilled, hybrid, trees) have no vLLM form: refused, one line.

The recommendation per category and overall is the candidate of the highest measured decode
speedup over `ar` (paired per prompt), or `ar` itself where nothing beats it. vLLM alone runs once
more after the last candidate (`ar again`): on a machine whose speed drifts, its ratio to the
first says how far apart two candidates must be before the difference is theirs. The files: DIR/
results.jsonl, summary.json, report.md and plots of every candidate together (bench's), and
tune-vllm.json and tune-vllm.md: the per-category choice, the winner's `vllm serve` command line
(also as `python -m vllm.entrypoints.openai.api_server`), its tensor-parallel form and its Ray
Serve LLM `engine_kwargs`. The winner's command line is the one its measured server ran (on
another port), so the export served in the same run; `check_forms` has vLLM's own argument parser
read the multi-GPU forms.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.bench.aggregate import OVERALL
from specdecode.bench.server_bench import BASELINE, ServerBenchConfig, merge_runs, run_server_bench
from specdecode.bench.vllm_server import VllmServer
from specdecode.config import RunConfig, to_vllm_speculative_config
from specdecode.core.draft_spec import VLLM_DRAFT_ENV, DraftSpec

PROPOSERS = "specdecode.integrations.vllm"
SERVED_NAME = "target"
AGAIN = "ar again"  # vLLM alone, measured last: the drift check
DEFAULT_KS = (2, 4)


@dataclass(frozen=True)
class Candidate:
    label: str
    speculative_config: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)


def candidates(drafts: list[str], ks: list[int]) -> list[Candidate]:
    """`ar`, then every draft at every k in the forms vLLM takes (module docstring)."""
    out = [Candidate(BASELINE, None)]
    for draft in drafts:
        spec = DraftSpec.parse(draft)
        for k in ks:
            if spec.kind == "suffix":
                out.append(ours_candidate("SuffixProposer", draft, k))
                continue
            exported = to_vllm_speculative_config(RunConfig(target=None, draft=draft, k=k))
            out.append(Candidate(f"vllm {draft} k={k}", exported))
            if spec.kind == "ngram":
                out.append(ours_candidate("NgramProposer", draft, k))
    return out


def ours_candidate(proposer: str, draft: str, k: int) -> Candidate:
    config = {
        "method": "custom_class",
        "model": f"{PROPOSERS}.{proposer}",
        "num_speculative_tokens": k,
    }
    return Candidate(f"ours {draft} k={k}", config, {VLLM_DRAFT_ENV: draft})


@dataclass
class VllmTuneConfig:
    python: str  # the `python` of vLLM's environment
    target: str  # a folder or hub id vLLM loads
    drafts: list[str]
    out: str
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_KS))
    prompts_file: str | None = None
    categories: list[str] | None = None
    limit: int = 2
    max_new_tokens: int = 64
    chat: bool = True
    dtype: str = "bfloat16"
    vllm_args: list[str] = field(default_factory=list)  # more `vllm serve` arguments
    drift_check: bool = True  # vLLM alone once more at the end
    command: str | None = None

    def validate(self) -> list[Candidate]:
        if not self.drafts:
            raise ValueError("tune needs at least one candidate --draft")
        bad = [k for k in self.ks if k < 1]
        if bad or not self.ks:
            raise ValueError(f"--vllm-k: each k is >= 1 (got {self.ks})")
        for name, value in (("--limit", self.limit), ("--max-new-tokens", self.max_new_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1 (got {value})")
        return candidates(self.drafts, self.ks)

    def server(self, candidate: Candidate, log: Path | None = None) -> VllmServer:
        args = ["--dtype", self.dtype, *self.vllm_args]
        return VllmServer(
            self.python,
            self.target,
            served_name=SERVED_NAME,
            speculative_config=candidate.speculative_config,
            args=args,
            env=dict(candidate.env),
            log=str(log) if log else None,
        )


def run_tune_vllm(config: VllmTuneConfig, progress: bool = True) -> dict[str, Any]:
    """Measure every candidate on its own server; recommend; write DIR/tune-vllm.{json,md}."""
    chosen = config.validate()
    out = Path(config.out)
    # vLLM alone once more at the end: how far the machine's speed moved during the run
    again = [Candidate(AGAIN, None)] if config.drift_check else []
    folders, failed = measure(config, chosen + again, out / "candidates", progress)
    summary = merge_runs(folders, out, command=config.command, failed=failed)
    best = recommend(summary)
    winner = next(c for c in chosen if c.label == best[OVERALL]["setting"])
    result = {
        "command": config.command,
        "target": config.target,
        "candidates": [c.label for c in chosen],
        "failed": failed,
        "recommended": best,
        "speculative_config": winner.speculative_config,
        "environment": winner.env,
        "forms": export_forms(config, winner),
        "drift": drift(summary),
    }
    try:
        result["forms_checked"] = check_forms(config.server(winner))
    except (ValueError, subprocess.TimeoutExpired, OSError) as err:
        result["forms_checked"] = None
        result["forms_refused"] = str(err)
    (out / "tune-vllm.json").write_text(json.dumps(result, indent=1))
    (out / "tune-vllm.md").write_text(render_tune_vllm(result))
    return result


def measure(
    config: VllmTuneConfig, chosen: list[Candidate], root: Path, progress: bool = True
) -> tuple[list[Path], dict[str, str]]:
    """Each candidate on a vLLM server of its own, one after another, through `bench --server`
    into root/<label>: the folders measured and {label: why} for those vLLM refused. A folder
    already measured (its summary written) is kept, so an interrupted run goes on where it
    stopped; without the `ar` baseline nothing compares, so its failure stops the run."""
    folders, failed = [], {}
    for number, candidate in enumerate(chosen, 1):
        folder = root / re.sub(r"[^A-Za-z0-9.=-]+", "_", candidate.label).strip("_")
        if (folder / "summary.json").exists():
            folders.append(folder)
            continue
        server = config.server(candidate, folder / "vllm.log")
        if progress:
            print(f"[{number}/{len(chosen)}] {candidate.label}: starting vLLM", flush=True)
        try:
            with server.running() as url:
                bench = ServerBenchConfig(
                    servers=[f"{candidate.label}={url}"],
                    out=str(folder),
                    model=SERVED_NAME,
                    prompts_file=config.prompts_file,
                    categories=config.categories,
                    limit=config.limit,
                    chat=config.chat,
                    max_new_tokens=config.max_new_tokens,
                    command=server.serve_command(),
                )
                run_server_bench(bench, progress)
            folders.append(folder)
        except ValueError as err:
            if candidate.label == BASELINE:
                raise  # no baseline, no speedups: stop here
            failed[candidate.label] = str(err)
            if progress:
                print(f"    skipped: {err}", flush=True)
    return folders, failed


def drift(summary: dict[str, Any]) -> float | None:
    """vLLM alone at the end over vLLM alone at the start (decode tokens/s, all prompts): 1.0
    on a machine whose speed held; None without the second run."""
    rows = {r["setting"]: r for r in summary["rows"] if r["category"] == OVERALL}
    if AGAIN not in rows:
        return None
    return rows[AGAIN]["speedup"]


def recommend(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per category and overall: the candidate of the highest measured decode speedup over
    `ar`, with its acceptance and identity; `ar` where none is faster."""
    best: dict[str, dict[str, Any]] = {}
    for category in [OVERALL, *summary["categories"]]:
        rows = [r for r in summary["rows"] if r["category"] == category and r["setting"] != AGAIN]
        ar = next(r for r in rows if r["setting"] == BASELINE)
        row = max(rows, key=lambda r: r["speedup"] or 0.0)
        if (row["speedup"] or 0.0) <= 1.0:
            row = ar
        best[category] = {
            "setting": row["setting"],
            "speedup": row["speedup"],
            "acceptance_rate": row.get("acceptance_rate"),
            "decode_tokens_per_s": row["decode_tokens_per_s"],
            "ar_decode_tokens_per_s": ar["decode_tokens_per_s"],
            "identical": f"{row['identical']}/{row['compared']}" if row["compared"] else None,
        }
    return best


def export_forms(config: VllmTuneConfig, winner: Candidate) -> dict[str, str]:
    """The winner as a user starts it: one machine, several GPUs, and Ray Serve LLM."""
    server = config.server(winner)
    env = " ".join(f"{k}={v}" for k, v in winner.env.items())
    prefix = f"{env} " if env else ""
    serve = prefix + server.serve_command()
    module = prefix + shlex.join(["python", *server.command(8000)[1:]])
    engine_kwargs: dict[str, Any] = {"tensor_parallel_size": 2, "dtype": config.dtype}
    if winner.speculative_config is not None:
        engine_kwargs["speculative_config"] = winner.speculative_config
    ray = (
        "from ray import serve\n"
        "from ray.serve.llm import LLMConfig, build_openai_app\n\n"
        "llm_config = LLMConfig(\n"
        f"    model_loading_config={{'model_id': {SERVED_NAME!r}, 'model_source': "
        f"{config.target!r}}},\n"
        "    deployment_config={'autoscaling_config': {'min_replicas': 1, 'max_replicas': 2}},\n"
        f"    engine_kwargs={json.dumps(engine_kwargs)},\n"
        + (f"    runtime_env={{'env_vars': {json.dumps(winner.env)}}},\n" if winner.env else "")
        + ")\n"
        "serve.run(build_openai_app({'llm_configs': [llm_config]}))\n"
    )
    return {
        "vllm_serve": serve,
        "python_module": module,
        "tensor_parallel": serve + " --tensor-parallel-size 2",
        "ray_serve_llm": ray,
    }


CHECK_FORMS = """
import json, sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # vLLM before its launchers package
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.config import ParallelConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
engine = AsyncEngineArgs.from_cli_args(args)
model = engine.create_model_config()
parallel = ParallelConfig(tensor_parallel_size=engine.tensor_parallel_size)
spec = engine.create_speculative_config(model, parallel)
print(json.dumps({"tensor_parallel_size": parallel.tensor_parallel_size,
                  "speculative_method": getattr(spec, "method", None),
                  "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None)}))
"""


def check_forms(server: VllmServer, timeout_s: float = 300.0) -> dict[str, Any]:
    """vLLM's own classes read the tensor-parallel form (its arguments, the target's model
    config and the speculative config built for 2 GPUs; no GPU needed): what they made of it,
    or ValueError with vLLM's last line."""
    argv = [*server.command(8000)[3:], "--tensor-parallel-size", "2"]
    done = subprocess.run(
        [server.python, "-c", CHECK_FORMS, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=server.environment(),
    )
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise ValueError(f"vLLM refused the form: {lines[-1] if lines else done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render_tune_vllm(result: dict[str, Any]) -> str:
    best = result["recommended"]
    lines = [
        "# Tuning vLLM",
        "",
        f"Command: `{result['command']}`",
        "",
        "Measured decode speedup of each candidate over vLLM without speculation (`ar`), each "
        "on its own server, one after another, on the same prompts; acceptance from vLLM's "
        "counters; identity: greedy texts equal to `ar`'s. The full tables: report.md.",
        "",
        "| category | recommended | decode speedup | α | tok/s (ar) | identical |",
        "|---|---|---|---|---|---|",
    ]
    for category, row in best.items():
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        alpha = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
        rate = f"{row['decode_tokens_per_s']:.2f} ({row['ar_decode_tokens_per_s']:.2f})"
        lines.append(
            f"| {category} | {row['setting']} | {speedup} | {alpha} | {rate} | "
            f"{row['identical'] or '-'} |"
        )
    moved = result.get("drift")
    if moved is not None:
        lines += [
            "",
            f"vLLM alone, measured again after the last candidate, decoded {moved:.2f}x as fast "
            "as at the start: each candidate ran minutes after the one before, so differences "
            f"between candidates within {abs(moved - 1):.0%} or so are the machine's, not the "
            "settings' (candidates that draft alike, such as vLLM's `ngram` and our "
            "`NgramProposer`, show it too).",
        ]
    forms = result["forms"]
    lines += [
        "",
        "## Serve the recommendation",
        "",
        "```bash",
        forms["vllm_serve"],
        "# the same with the environment's python (where `vllm` does not find its version):",
        forms["python_module"],
        "# several GPUs on one machine:",
        forms["tensor_parallel"],
        "```",
        "",
        "Ray Serve LLM (several machines):",
        "",
        "```python",
        forms["ray_serve_llm"].rstrip(),
        "```",
    ]
    if result.get("forms_checked"):
        lines += [
            "",
            f"vLLM's own classes read the tensor-parallel form: {result['forms_checked']}.",
        ]
    if result.get("forms_refused"):
        lines += ["", f"vLLM did not read the tensor-parallel form: {result['forms_refused']}"]
    for label, why in result["failed"].items():
        lines += ["", f"Not measured: `{label}`: {why}"]
    return "\n".join(lines) + "\n"
