"""`specdecode tune --engine vllm`: measure vLLM's speculative settings, and ours inside vLLM.

vLLM without speculation (`ar`) runs on a server kept up for the whole run; every other
candidate is a vLLM server started from the user's vLLM environment (vllm_server.py) with one
`speculative_config`, measured by `bench --server` beside `ar` on the user's prompts (one category
at a time, each prompt to both servers in turn, one request at a time, acceptance from vLLM's
counters) and stopped before the next starts. So a candidate's speedup pairs its requests with
`ar`'s of the same minutes, not with a server measured half an hour before: on a machine whose
speed drifts (a shared VM), candidates started one after another were 1.5x apart for the same
drafts (docs/results.md). An idle server takes next to no CPU, so each request still has the
machine to itself. The candidates, per `--draft` and per k of `ks`:

- `ar`: vLLM without speculation, the baseline of every speedup and identity check;
- a model: vLLM's `draft_model` method; `ngram:MIN-MAX`: vLLM's `ngram` method and our
  `NgramProposer` (its `custom_class` method); `suffix[:OPTIONS]`: our `SuffixProposer`
  (vLLM's own `suffix` method needs Arctic Inference, which its CPU build lacks);
- other drafts (early exit, distilled, hybrid, trees) have no vLLM form: refused, one line.

The recommendation per category and overall is the candidate of the highest measured decode
speedup over the `ar` requests beside it (paired per prompt), or `ar` itself where nothing beats
it. `drift`: `ar`'s decode rate beside the last candidate over beside the first, how far the
machine's speed moved during the run. The files: DIR/
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
    """Measure every candidate on its own server beside `ar`'s; recommend; write
    DIR/tune-vllm.{json,md}."""
    chosen = config.validate()
    out = Path(config.out)
    folders, failed = measure(config, chosen, out / "candidates", progress)
    if not folders:
        raise ValueError(f"vLLM refused every candidate: {'; '.join(failed.values())}")
    # each candidate's records pair with the `ar` requests measured beside it
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
        "drift": drift(folders),
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
    """`ar` on a server kept up for the whole run; each other candidate on a server of its own,
    one after another, measured through `bench --server` beside `ar` (the module docstring)
    into root/<label>: the folders measured and {label: why} for those vLLM refused. A folder
    already measured (its summary written) is kept, so an interrupted run goes on where it
    stopped; without `ar` nothing compares, so its failure to start stops the run."""
    others = [c for c in chosen if c.label != BASELINE]
    folders = {c.label: _folder(root, c) for c in others}
    failed: dict[str, str] = {}
    todo = [c for c in others if not (folders[c.label] / "summary.json").exists()]
    if todo:
        root.mkdir(parents=True, exist_ok=True)
        if progress:
            print(f"{BASELINE}: starting vLLM without speculation (kept up)", flush=True)
        with config.server(Candidate(BASELINE, None), root / "ar-vllm.log").running() as ar:
            for number, candidate in enumerate(todo, 1):
                folder = folders[candidate.label]
                server = config.server(candidate, folder / "vllm.log")
                if progress:
                    print(f"[{number}/{len(todo)}] {candidate.label}: starting vLLM", flush=True)
                try:
                    with server.running() as url:
                        bench = ServerBenchConfig(
                            servers=[f"{BASELINE}={ar}", f"{candidate.label}={url}"],
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
                except ValueError as err:
                    failed[candidate.label] = str(err)
                    if progress:
                        print(f"    skipped: {err}", flush=True)
    done = [folders[c.label] for c in others if (folders[c.label] / "summary.json").exists()]
    return done, failed


def _folder(root: Path, candidate: Candidate) -> Path:
    return root / re.sub(r"[^A-Za-z0-9.=-]+", "_", candidate.label).strip("_")


def drift(folders: list[Path]) -> float | None:
    """`ar`'s decode tokens/s (all prompts) beside the last candidate over beside the first:
    1.0 on a machine whose speed held; None with fewer than two candidates measured."""
    if len(folders) < 2:
        return None

    def ar_rate(folder: Path) -> float | None:
        summary = json.loads((folder / "summary.json").read_text())
        return next(
            r["decode_tokens_per_s"]
            for r in summary["rows"]
            if r["setting"] == BASELINE and r["category"] == OVERALL
        )

    first, last = ar_rate(folders[0]), ar_rate(folders[-1])
    return last / first if first and last else None


def recommend(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per category and overall: the candidate of the highest measured decode speedup over
    `ar`, with its acceptance and identity; `ar` where none is faster."""
    best: dict[str, dict[str, Any]] = {}
    for category in [OVERALL, *summary["categories"]]:
        rows = [r for r in summary["rows"] if r["category"] == category]
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
        "Measured decode speedup of each candidate over vLLM without speculation (`ar`): each "
        "candidate on its own server, one after another, beside an `ar` server kept up, the "
        "same prompts to both in turn, each candidate's requests paired with `ar`'s of the "
        "same minutes; acceptance from vLLM's counters; identity: greedy texts equal to the "
        "paired `ar`'s. The full tables: report.md.",
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
            f"`ar` decoded {moved:.2f}x as fast beside the last candidate as beside the first: "
            "the machine's speed moved that much during the run, which the pairing keeps out "
            "of each candidate's speedup.",
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
