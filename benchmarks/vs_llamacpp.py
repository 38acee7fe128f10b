"""Our decoding beside llama.cpp's, on the bench suite's prompts, the same prompt tokens on both sides.

    python -m benchmarks.vs_llamacpp --llama-bin ~/llama.cpp/build/bin --out runs/vs-llamacpp

Never run in CI and builds nothing: `--llama-bin` is the folder of an already built llama.cpp
(llama-completion, llama-speculative-simple, llama-bench). The GGUF files default to the presets'
own, rebuilt from the kept wheels (`specdecode models gguf`). Per prompt, in an order rotated
from prompt to prompt, every method runs once, greedy, at most `--max-new-tokens`:

- `llama.cpp`: llama-completion on the prompt already formatted by our chat template (no
  conversation mode), its timing lines parsed; its prompt token ids are checked against ours;
- `llama.cpp spec draft-max=D`: llama-speculative-simple with the draft GGUF, per `--llama-draft-max`;
- ours, in this process through the engine (bench/methods.py's MethodRunner, prefill timed
  apart from decode), one row per `--ours` setting (llamacpp_io.OursSpec).

llama-bench's tg`N` runs once first, as the tool's own reference number. Writes results.json
and report.md under `--out` (results.json after every prompt) and prints the report, its main
table last. Definitions: the report's header and lab/benchmarks.md ("vs llama.cpp").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks import llamacpp_io as lio
from specdecode.bench.methods import MethodRunner, Setting
from specdecode.bench.records import Record, make_record, mark_identity, top2_margin
from specdecode.core import metrics
from specdecode.core.draft_spec import resolve_draft_vocab
from specdecode.data.suites import CATEGORIES, BenchPrompt, interleave_by_category, load_suite
from specdecode.drafters import resolve_draft
from specdecode.drafters.tree_shape import parse_tree_spec
from specdecode.models.fetch import rebuild_gguf
from specdecode.models.loading import LoadedModel, load_model

WARM_UP_TOKENS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--llama-bin",
        type=Path,
        required=True,
        metavar="DIR",
        help="folder of llama.cpp's built tools (" + ", ".join(lio.TOOLS) + ")",
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target preset")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="draft preset")
    parser.add_argument(
        "--target-gguf",
        type=Path,
        default=None,
        help="the target's GGUF (default: the preset's, `specdecode models gguf`)",
    )
    parser.add_argument("--draft-gguf", type=Path, default=None, help="the draft's GGUF (same)")
    parser.add_argument(
        "--categories",
        default=",".join(CATEGORIES),
        help="comma-separated categories of the built-in suite (default: all)",
    )
    parser.add_argument("--limit", type=int, default=2, help="prompts per category (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--llama-draft-max",
        default="3",
        help="llama-speculative-simple's --spec-draft-n-max, a comma list (default 3)",
    )
    parser.add_argument(
        "--ours",
        action="append",
        default=None,
        metavar="SPEC",
        help=f"one of our settings, repeatable; {lio.OURS_FORMS} "
        f"(default: {' / '.join(lio.DEFAULT_OURS)})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"threads for both sides (default: torch's, {torch.get_num_threads()} here)",
    )
    parser.add_argument("--ctx-size", type=int, default=4096, help="llama.cpp's -c (default 4096)")
    parser.add_argument(
        "--bench-repetitions", type=int, default=5, help="llama-bench -r (default 5)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per llama.cpp call")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    args = parser.parse_args(argv)
    try:
        args.ours_specs = [lio.OursSpec.parse(s) for s in (args.ours or lio.DEFAULT_OURS)]
        for spec in args.ours_specs:
            if spec.tree is not None:
                parse_tree_spec(spec.tree)  # a bad shape fails before anything is loaded
    except ValueError as err:
        parser.error(str(err))
    try:
        args.draft_max = [int(d) for d in args.llama_draft_max.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--llama-draft-max: comma-separated integers (got {args.llama_draft_max!r})")
    if any(d < 1 for d in args.draft_max):
        parser.error(f"--llama-draft-max: each at least 1 (got {args.llama_draft_max!r})")
    if args.max_new_tokens < 2 or args.limit < 1:
        parser.error("--max-new-tokens is at least 2 and --limit at least 1")
    missing = [t for t in lio.TOOLS if not (args.llama_bin / t).is_file()]
    if missing:
        parser.error(
            f"--llama-bin {args.llama_bin}: no {', '.join(missing)} there (build llama.cpp first)"
        )
    labels = [s.label for s in args.ours_specs]
    if len(set(labels)) != len(labels):
        parser.error(f"--ours names a setting twice: {labels}")
    return args


# --------------------------------------------------------------------------------------------
# Our side


class Ours:
    """Our settings: one MethodRunner per target form, the drafts loaded once and shared."""

    def __init__(self, target: str, draft: str, specs: list[lio.OursSpec]) -> None:
        self.specs = specs
        targets: dict[str, LoadedModel] = {}
        for form in dict.fromkeys(s.target for s in specs):
            name = f"{target}:{form}" if form in ("int4", "int8") else target
            targets[form] = load_model(name, role="target")
        drafts: dict[str, Any] = {}
        for form in dict.fromkeys(s.draft for s in specs if s.draft):
            label = draft if form == "bf16" else f"{draft}:{form}"
            drafts[label] = resolve_draft(label, targets[specs[0].target])
        self.runners = {form: MethodRunner(model, drafts) for form, model in targets.items()}
        self.draft_labels = {
            form: draft if form == "bf16" else f"{draft}:{form}" for form in lio.DRAFT_FORMS
        }
        self.kernels = {
            s.label: ", ".join(
                [f"target {targets[s.target].kernel}"]
                + ([f"draft {drafts[self.draft_labels[s.draft]].kernel}"] if s.draft else [])
            )
            for s in specs
        }
        self.tokenizer = next(iter(targets.values())).tokenizer
        self.engine = next(iter(self.runners.values())).ar_engine

    def setting(self, spec: lio.OursSpec) -> Setting:
        if spec.draft is None:
            return Setting("ar")
        return Setting("spec", self.draft_labels[spec.draft], spec.k, "fixed", spec.tree)

    def prompt(self, prompt: BenchPrompt) -> tuple[str, list[int]]:
        """The prompt's text as our chat template formats it (what llama.cpp gets) and its ids."""
        messages = [{"role": "user", "content": prompt.turns[0]}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return text, self.engine.encode_prompt(prompt.turns[0], chat=True)

    def run(self, spec: lio.OursSpec, prompt: BenchPrompt, ids: list[int], n: int) -> Record:
        out = self.runners[spec.target].run(self.setting(spec), ids, n)
        return make_record(
            prompt,
            0,
            0,
            self.setting(spec),
            ids,
            out,
            dtype=spec.target,
            temperature=0.0,
            memory_bytes=0,
            memory_source="",
        )


def ours_row(spec: lio.OursSpec, record: Record, text: str) -> dict[str, Any]:
    # the target prefills the prompt but its last token (the first step feeds that one)
    prefill = metrics.ratio(record.prompt_tokens - 1, record.prefill_s or 0.0)
    return {
        "prompt_id": record.prompt_id,
        "category": record.category,
        "method": spec.label,
        "family": "ours",
        "prompt_tokens": record.prompt_tokens,
        "tool_prompt_tokens": None,
        "prompt_match": None,
        "new_tokens": record.new_tokens,
        "prefill_tokens_per_s": prefill,
        "decode_tokens_per_s": record.decode_tokens_per_s,
        "tokens_per_s": record.tokens_per_s,
        "acceptance_rate": record.acceptance_rate if spec.speculative else None,
        "mean_acceptance_length": record.mean_acceptance_length if spec.speculative else None,
        "identical_to_target": None,
        "first_divergence": None,
        "token_ids": record.token_ids,
        "text": text,
    }


# --------------------------------------------------------------------------------------------
# llama.cpp's side


def call(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run one llama.cpp tool; RuntimeError with the end of its stderr when it fails."""
    return lio.run_tool(command, timeout)


def llama_row(
    method: str, prompt: BenchPrompt, ids: list[int], run: lio.LlamaRun
) -> dict[str, Any]:
    match = run.prompt_ids == ids if run.prompt_ids is not None else run.prompt_tokens == len(ids)
    tau = acceptance = None
    if run.drafted is not None and run.accepted is not None:
        steps = run.new_tokens - run.accepted  # each step emits its accepted drafts + 1
        tau = metrics.mean_acceptance_length(run.new_tokens, steps)
        acceptance = metrics.acceptance_rate(run.accepted, run.drafted)
    return {
        "prompt_id": prompt.id,
        "category": prompt.category,
        "method": method,
        "family": "llama.cpp",
        "prompt_tokens": len(ids),
        "tool_prompt_tokens": run.prompt_tokens,
        "prompt_match": match,
        "new_tokens": run.new_tokens,
        "prefill_tokens_per_s": run.prefill_tokens_per_s,
        "decode_tokens_per_s": run.decode_tokens_per_s,
        "tokens_per_s": run.tokens_per_s,
        "acceptance_rate": acceptance,
        "mean_acceptance_length": tau,
        "identical_to_target": None,
        "first_divergence": None,
        "token_ids": None,
        "text": run.text,
    }


# --------------------------------------------------------------------------------------------
# The run


def mark_prompt(
    rows: dict[str, dict[str, Any]],
    records: dict[str, Record],
    ours: Ours,
    ids: list[int],
    spec_labels: list[str],
) -> None:
    """Greedy identity of one prompt's speculative rows: ours against our same target alone
    (token for token; a divergence with the target's top-2 margin there), llama.cpp's against
    its target alone (text, one a prefix of the other: it may run past the limit)."""
    for spec in ours.specs:
        base = records.get(spec.baseline)
        if spec.speculative and base is not None:
            record, model = records[spec.label], ours.runners[spec.target].target.model
            mark_identity(base, record, partial(top2_margin, model, ids, base.token_ids))
            rows[spec.label]["identical_to_target"] = record.identical_to_ar
            rows[spec.label]["first_divergence"] = record.first_divergence
    alone = rows[lio.LLAMA]["text"].rstrip()
    for label in spec_labels:
        text = rows[label]["text"].rstrip()
        rows[label]["identical_to_target"] = text.startswith(alone) or alone.startswith(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    prompts = interleave_by_category(load_suite(None, categories, args.limit))
    args.out.mkdir(parents=True, exist_ok=True)

    args.threads = threads
    target_gguf = args.target_gguf = args.target_gguf or rebuild_gguf(args.target)
    draft_gguf = args.draft_gguf = args.draft_gguf or rebuild_gguf(args.draft)
    for path in (target_gguf, draft_gguf):
        if not Path(path).is_file():
            raise SystemExit(f"vs_llamacpp: GGUF file {path} does not exist")
    proc = call([str(args.llama_bin / "llama-completion"), "--version"], 60)
    version = lio.parse_version(proc.stderr + proc.stdout)  # this version prints it on stderr
    print(
        f"llama.cpp {version.get('version')}, commit {version.get('commit', '?')}; "
        "loading our models ...",
        file=sys.stderr,
    )
    ours = Ours(args.target, args.draft, args.ours_specs)
    spec_labels = [lio.spec_label(d) for d in args.draft_max]
    methods = [lio.LLAMA, *spec_labels, *(s.label for s in args.ours_specs)]
    for spec in args.ours_specs:
        if spec.speculative and spec.baseline not in methods:
            print(
                f"note: no {spec.baseline} row, so {spec.label} gets no identity check",
                file=sys.stderr,
            )

    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": {
            "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(argv),
            "llama_bin": str(args.llama_bin),
            "target": args.target,
            "draft": args.draft,
            "target_gguf": str(target_gguf),
            "draft_gguf": str(draft_gguf),
            "categories": categories,
            "limit": args.limit,
            "max_new_tokens": args.max_new_tokens,
            "llama_draft_max": args.draft_max,
            "ours": [s.label for s in args.ours_specs],
            "ours_kernels": ours.kernels,
            "ctx_size": args.ctx_size,
            "draft_vocab": resolve_draft_vocab(None),  # ids our draft's output layer computes
        },
        "machine": lio.machine(threads),
        "llama_cpp": version,
        "llama_bench": None,
        "methods": methods,
        "runs": [],
    }

    print(f"llama-bench tg{args.max_new_tokens} ...", file=sys.stderr)
    bench = call(
        lio.bench_command(
            args.llama_bin, target_gguf, args.max_new_tokens, threads, args.bench_repetitions
        ),
        args.timeout,
    )
    results["llama_bench"] = lio.parse_bench(bench.stdout)

    encoded = [(p, *ours.prompt(p)) for p in prompts]
    for _, _, ids in encoded:
        if len(ids) + args.max_new_tokens + 8 > args.ctx_size:
            raise SystemExit(
                f"vs_llamacpp: a prompt of {len(ids)} tokens does not fit --ctx-size {args.ctx_size}"
            )
    warm = encoded[0][2]
    for spec in tqdm(args.ours_specs, desc="warm-up (ours)", file=sys.stderr):
        ours.run(spec, prompts[0], warm, WARM_UP_TOKENS)

    bar = tqdm(
        total=len(prompts) * len(methods), desc="prompts x methods", unit="run", file=sys.stderr
    )
    for i, (prompt, text, ids) in enumerate(encoded):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        rows: dict[str, dict[str, Any]] = {}
        records: dict[str, Record] = {}
        for method in order:
            bar.set_postfix_str(f"{prompt.id}: {method}")
            rows[method] = run_method(method, args, ours, prompt, text, ids, records)
            bar.update(1)
        mark_prompt(rows, records, ours, ids, spec_labels)
        results["runs"] += [rows[m] for m in methods]
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    bar.close()

    report = lio.render_report(results)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0


def run_method(
    method: str,
    args: argparse.Namespace,
    ours: Ours,
    prompt: BenchPrompt,
    text: str,
    ids: list[int],
    records: dict[str, Record],
) -> dict[str, Any]:
    """One prompt x method: its results row (and, for ours, its Record in `records`). `text`
    is the chat-formatted prompt llama.cpp gets, `ids` its tokens on our side."""
    n, threads, target_gguf = args.max_new_tokens, args.threads, args.target_gguf
    if method == lio.LLAMA:
        command = lio.completion_command(
            args.llama_bin, target_gguf, text, n, threads, args.ctx_size
        )
        proc = call(command, args.timeout)
        return llama_row(method, prompt, ids, lio.parse_completion(proc.stderr, proc.stdout))
    for draft_max in args.draft_max:
        if method == lio.spec_label(draft_max):
            command = lio.speculative_command(
                args.llama_bin,
                target_gguf,
                args.draft_gguf,
                text,
                n,
                threads,
                args.ctx_size,
                draft_max,
            )
            proc = call(command, args.timeout)
            return llama_row(
                method, prompt, ids, lio.parse_speculative(proc.stderr, proc.stdout, text)
            )
    spec = next(s for s in args.ours_specs if s.label == method)
    record = ours.run(spec, prompt, ids, n)
    records[method] = record
    return ours_row(spec, record, ours.tokenizer.decode(record.token_ids, skip_special_tokens=True))


if __name__ == "__main__":
    sys.exit(main())
