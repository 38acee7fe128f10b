"""`specdecode compare`: speculation, quantization and pruning side by side, on speed and quality.

Order of work, in one process: load the reference target (the dtype asked for, bfloat16 by
default) and the draft; make every variant from the reference (bench/variants.py: quantized
copies, pruned copies chosen on calibration text); warm every run up; then per prompt, in an
order rotated by the prompt's index, every variant alone and with speculation (greedy), and the
reference alone and speculative at the sampling temperature, each timed by the bench's
`MethodRunner` and recorded as a `Record` (results.jsonl, written as it comes). After each
prompt's runs the reference's greedy answer is the reference text every variant is scored on
(bench/quality.py). Then every variant answers the task set alone (data/tasks.py). compare.json
holds one row per technique, report.md the table and the quality-vs-speed plot
(bench/compare_report.py).

Speedups are paired geometric means over prompts (bench/aggregate.py) against the reference
alone: greedy rows against the greedy reference, the sampled rows against the reference sampled
at the same temperature. A speculative row reproduces its target (`lossless_to`): its quality
columns are its target's, and greedy it is checked token for token on every timed prompt
(`identical` of `compared`).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from specdecode.bench.aggregate import aggregate_group, baseline_map
from specdecode.bench.compare_report import write_report
from specdecode.bench.memory import decode_bytes
from specdecode.bench.methods import MethodRunner, Setting
from specdecode.bench.quality import OVERALL, QualityTally, score_text
from specdecode.bench.records import Record, make_record, mark_identity, top2_margin
from specdecode.bench.variants import (
    Variant,
    calibration_cache,
    calibration_sequences,
    check_fits,
    check_variants,
    make_variant,
    parse_variants,
)
from specdecode.core.draft_spec import DraftSpec
from specdecode.data.suites import BenchPrompt, interleave_by_category, load_suite
from specdecode.data.tasks import load_tasks, pass_rates, run_tasks
from specdecode.drafters import resolve_draft
from specdecode.drafters.tree_shape import parse_tree_spec
from specdecode.models import presets
from specdecode.models.device import resolve_device, resolve_dtype
from specdecode.models.loading import LoadedModel, load_model

COMPARE, RESULTS, REPORT = "compare.json", "results.jsonl", "report.md"
MEMORY_SOURCE = "weights + key/value caches (computed)"
_SHORT_DTYPE = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


@dataclass
class CompareConfig:
    target: str
    draft: str
    variants: list[str] = field(default_factory=lambda: ["int8", "int4"])
    ks: list[int] = field(default_factory=lambda: [4])
    trees: list[str] = field(default_factory=list)  # token-tree shapes, for a model draft
    sample_temperature: float = 0.7  # the speculative-sampling row; 0 leaves it out
    max_new_tokens: int = 64
    limit: int | None = None  # prompts per category scored and timed
    tasks: int | None = None  # problems per kind (None: all, 0: none)
    categories: list[str] | None = None
    prompts_file: str | None = None
    # the last prompts of each category make the pruning's calibration text, never scored
    calibration_prompts: int = 2
    chat: bool = True
    dtype: str = "bfloat16"
    device: str | None = None
    seed: int = 0
    out: str = "runs/compare"
    command: str = ""

    def validate(self) -> list[Variant]:
        """The parsed variants; ValueError for any bad option, before anything is loaded."""
        variants = parse_variants(self.variants)
        if not self.draft:
            raise ValueError("compare needs a --draft: speculation is one of the techniques")

        spec = DraftSpec.parse(self.draft)
        for tree in self.trees:
            parse_tree_spec(tree)
        if self.trees and not spec.drafts_trees:
            raise ValueError(
                f"--tree needs a model draft, early-exit:N or eagle3:DIR (got {self.draft})"
            )
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"--k takes look-aheads >= 1 (got {self.ks})")
        if self.sample_temperature < 0:
            raise ValueError(f"--sample-temperature must be >= 0 (got {self.sample_temperature})")
        for name in ("max_new_tokens", "calibration_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1 (got {self.limit})")
        if self.tasks is not None and self.tasks < 0:
            raise ValueError(f"--tasks must be >= 0 (got {self.tasks})")
        check_variants(variants, resolve_dtype(self.dtype), resolve_device(self.device))
        return variants


@dataclass(frozen=True)
class Job:
    """One timed run per prompt: a variant (or the reference), a temperature, a setting."""

    variant: str
    temperature: float
    setting: Setting

    @property
    def speculative(self) -> bool:
        return self.setting.method == "spec"


def split_prompts(
    prompts: list[BenchPrompt], calibration: int, limit: int | None
) -> tuple[list[BenchPrompt], list[BenchPrompt]]:
    """(scored prompts, calibration prompts): per category the last `calibration` prompts (at
    most all but one) calibrate the pruning and are never scored; of the rest, the first
    `limit` are scored."""
    by_category: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    scored, calib = [], []
    for group in by_category.values():
        n_calib = min(calibration, len(group) - 1)
        rest = group[: len(group) - n_calib]
        scored += rest[:limit]
        calib += group[len(group) - n_calib :]
    return interleave_by_category(scored), calib


def run_compare(
    config: CompareConfig,
    target: LoadedModel | None = None,
    draft: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the comparison `config` describes and write DIR/{compare.json,report.md,...};
    `target` / `draft` (already loaded) replace loading `config.target` / `config.draft`."""
    variants = config.validate()
    prompts, calib_prompts = split_prompts(
        load_suite(config.prompts_file, categories=config.categories),
        config.calibration_prompts,
        config.limit,
    )
    if any(v.pruned for v in variants) and not calib_prompts:
        raise ValueError(
            "pruned variants calibrate on the last prompts of each category, which are then "
            "never scored; no category here has more than one prompt: give more prompts"
        )
    tasks = load_tasks(config.tasks) if config.tasks != 0 else []
    reference, draft = _load(config, target, draft, variants)
    ref_name = _SHORT_DTYPE.get(reference.dtype, str(reference.dtype).removeprefix("torch."))
    models = {ref_name: reference}
    info: dict[str, Any] = {ref_name: {"reference": True}}
    calibration = None
    if any(v.pruned for v in variants):
        calibration = calibration_sequences(
            reference,
            calib_prompts,
            config.max_new_tokens,
            chat=config.chat,
            cache=calibration_cache(),
            progress=progress,
        )
    for variant in variants:
        models[str(variant)], info[str(variant)] = make_variant(reference, variant, calibration)
    for name, loaded in models.items():
        info[name].update(_structure(loaded.model), kernel=loaded.kernel)

    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs, runners = _plan(config, models, ref_name, draft)
    records, tally = _measure(config, jobs, runners, models, ref_name, prompts, out_dir, progress)
    task_results = {
        name: run_tasks(runners[name, 0.0].ar_engine, tasks, config.chat, progress, f"tasks {name}")
        for name in models
        if tasks
    }
    result = _result(
        config, jobs, records, tally.summary(), task_results, info, ref_name, reference, draft
    )
    result["calibration"] = {
        "prompts": [p.id for p in calib_prompts] if calibration else [],
        "tokens": sum(len(s) for s in calibration) if calibration else 0,
    }
    (out_dir / COMPARE).write_text(json.dumps(result, indent=1))
    write_report(out_dir, result)
    return result


def _load(
    config: CompareConfig, target: LoadedModel | None, draft: Any, variants: list[Variant]
) -> tuple[Any, Any]:
    """The reference target and the draft; each variant checked against the target before the
    draft is loaded or anything is calibrated."""
    if target is None:
        target = load_model(config.target, dtype=config.dtype, device=config.device)
    for variant in variants:
        check_fits(variant, target)
    if draft is None:
        draft = resolve_draft(config.draft, target, dtype=config.dtype, device=config.device)
    return target, draft


def _draft_for(config: CompareConfig, draft: Any, target: LoadedModel) -> Any:
    """The drafter over `target`: an early exit runs the variant's own first layers; any other
    draft (a model, prompt lookup) is shared by every variant."""
    if DraftSpec.parse(config.draft).kind == "early-exit":
        return resolve_draft(config.draft, target)
    return draft


def _plan(
    config: CompareConfig, models: dict[str, LoadedModel], ref_name: str, draft: Any
) -> tuple[list[Job], dict[tuple[str, float], MethodRunner]]:
    """Every job and the runner of each (variant, temperature)."""
    label = config.draft
    spec = [Setting("spec", label, k) for k in config.ks]
    spec += [Setting("spec", label, 0, "fixed", tree) for tree in config.trees]
    temperatures = {name: [0.0] for name in models}
    if config.sample_temperature > 0:
        temperatures[ref_name].append(config.sample_temperature)
    jobs, runners = [], {}
    for name, loaded in models.items():
        drafts = {label: _draft_for(config, draft, loaded)}
        for temperature in temperatures[name]:
            runners[name, temperature] = MethodRunner(
                loaded, drafts, temperature=temperature, seed=config.seed
            )
            jobs += [Job(name, temperature, s) for s in [Setting("ar"), *spec]]
    return jobs, runners


def _measure(
    config: CompareConfig,
    jobs: list[Job],
    runners: dict[tuple[str, float], MethodRunner],
    models: dict[str, LoadedModel],
    ref_name: str,
    prompts: list[BenchPrompt],
    out_dir: Path,
    progress: bool,
) -> tuple[dict[Job, list[Record]], QualityTally]:
    """Warm up, then per prompt every job (rotated order), identity marks, quality scores."""
    engine = runners[ref_name, 0.0].ar_engine
    inputs = [engine.encode_prompt(p.turns[0], chat=config.chat) for p in prompts]
    for job in tqdm(jobs, desc="warm-up", disable=not progress, leave=False):
        runners[job.variant, job.temperature].run(
            job.setting, inputs[0], min(8, config.max_new_tokens)
        )
    records: dict[Job, list[Record]] = {job: [] for job in jobs}
    tally = QualityTally()
    scored = {name: loaded.model for name, loaded in models.items()}
    bar = tqdm(total=len(prompts) * len(jobs), desc="compare", unit="run", disable=not progress)
    with (out_dir / RESULTS).open("w") as results:
        for index, (prompt, ids) in enumerate(zip(prompts, inputs, strict=True)):
            done: dict[Job, Record] = {}
            for job in jobs[index % len(jobs) :] + jobs[: index % len(jobs)]:
                bar.set_postfix_str(f"{prompt.id} {job.variant} {job.setting.label}", refresh=False)
                done[job] = _run_one(config, job, runners, models, prompt, ids)
                bar.update()
            _mark_identity(done, models, ids)
            for job in jobs:  # plan order, whatever the run order
                records[job].append(done[job])
                results.write(json.dumps(done[job].to_dict()) + "\n")
            results.flush()
            answer = done[Job(ref_name, 0.0, Setting("ar"))].token_ids
            bar.set_postfix_str(f"{prompt.id} quality", refresh=True)
            score_text(tally, models[ref_name].model, scored, prompt.category, ids, answer)
    bar.close()
    return records, tally


def _run_one(
    config: CompareConfig,
    job: Job,
    runners: dict[tuple[str, float], MethodRunner],
    models: dict[str, LoadedModel],
    prompt: BenchPrompt,
    ids: list[int],
) -> Record:
    runner = runners[job.variant, job.temperature]
    out = runner.run(job.setting, ids, config.max_new_tokens)
    drafter = runner.engine(job.setting).drafter if job.speculative else None
    memory = decode_bytes(models[job.variant].model, drafter, len(ids) + len(out.token_ids))
    record = make_record(
        prompt,
        0,
        0,
        job.setting,
        ids,
        out,
        dtype=config.dtype,
        temperature=job.temperature,
        memory_bytes=memory,
        memory_source=MEMORY_SOURCE,
    )
    record.extra["variant"] = job.variant
    return record


def _mark_identity(done: dict[Job, Record], models: dict[str, LoadedModel], ids: list[int]) -> None:
    """Each greedy speculative record against its own target alone (lossless to it)."""
    for job, record in done.items():
        if job.temperature or not job.speculative:
            continue
        alone = done[Job(job.variant, 0.0, Setting("ar"))]
        alone.identical_to_ar = True
        model = models[job.variant].model

        def margin(position: int, model: Any = model, alone: Record = alone) -> float:
            return top2_margin(model, ids, alone.token_ids, position)

        mark_identity(alone, record, margin)


def _structure(model: Any) -> dict[str, Any]:
    """Parameter count (each tensor once) and the decoder's shape."""
    seen: dict[int, int] = {}
    for param in model.parameters():
        seen.setdefault(id(param), param.numel())
    config = model.config
    return {
        "params": sum(seen.values()),
        "layers": getattr(config, "num_hidden_layers", None),
        "intermediate_size": getattr(config, "intermediate_size", None),
    }


def _result(
    config: CompareConfig,
    jobs: list[Job],
    records: dict[Job, list[Record]],
    quality: dict[str, dict[str, dict[str, Any]]],
    task_results: dict[str, list[dict[str, Any]]],
    info: dict[str, Any],
    ref_name: str,
    reference: LoadedModel,
    draft: Any,
) -> dict[str, Any]:
    """compare.json: the rows (the best speculative setting per target), every setting's row,
    quality per category, the tasks, what each variant is."""
    rates = {name: pass_rates(results) for name, results in task_results.items()}
    every = []
    for job in jobs:
        baseline = records[Job(ref_name, job.temperature, Setting("ar"))]
        alone = records[Job(job.variant, job.temperature, Setting("ar"))]
        aggregate = aggregate_group(records[job], alone, {"ar": baseline_map(baseline)})
        every.append(_row(job, aggregate, quality, rates, info, ref_name))
    rows = []
    for row in sorted(every, key=lambda r: r["temperature"] > 0):  # the sampled rows last
        if not row["speculative"]:
            rows.append(row)
            same = [
                r
                for r in every
                if r["speculative"]
                and r["variant"] == row["variant"]
                and r["temperature"] == row["temperature"]
            ]
            if same:
                rows.append(max(same, key=lambda r: r["decode_speedup"] or 0.0))
    divergences = [
        {"variant": job.variant, "setting": job.setting.label, "prompt_id": r.prompt_id}
        | r.first_divergence
        for job in jobs
        for r in records[job]
        if r.first_divergence
    ]

    return {
        "command": config.command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "target": config.target,
        "target_is_preset": config.target in presets.PRESETS,
        "draft": config.draft,
        "draft_name": getattr(draft, "name", type(draft).__name__),
        "reference": ref_name,
        "device": str(reference.device),
        "kernel": reference.kernel,
        "config": asdict(config),
        "rows": rows,
        "settings": every,
        "divergences": divergences,  # greedy speculative outputs unlike their target's
        "quality": quality,
        "tasks": {name: {"rates": rates[name], "results": r} for name, r in task_results.items()},
        "variants": info,
    }


def _row(
    job: Job,
    aggregate: dict[str, Any],
    quality: dict[str, dict[str, dict[str, Any]]],
    rates: dict[str, dict[str, Any]],
    info: dict[str, Any],
    ref_name: str,
) -> dict[str, Any]:
    """One technique's row: its quality (its target's; lossless to it) beside its speed."""
    sampled = job.temperature > 0
    scores = quality.get(job.variant, {}).get(OVERALL, {})
    task = {} if sampled else rates.get(job.variant, {})  # tasks run greedy
    if job.speculative:
        technique = f"speculation over {job.variant} ({job.setting.label})"
        if sampled:
            technique = f"speculative sampling T={job.temperature:g} over {job.variant}"
    else:
        technique = job.variant + (" (reference)" if job.variant == ref_name else "")
        if sampled:
            technique = f"{job.variant} sampled T={job.temperature:g}"

    def rate(kind: str) -> float | None:
        return task[kind]["rate"] if kind in task else None

    structure = info.get(job.variant, {})
    short = f"spec over {job.variant}" if job.speculative else job.variant
    return {
        "technique": technique,
        "label": f"{short} T={job.temperature:g}" if sampled else short,  # the plot's
        "variant": job.variant,
        "speculative": job.speculative,
        "temperature": job.temperature,
        "setting": job.setting.label,
        "k": job.setting.k if job.speculative and not job.setting.tree else None,
        "tree": job.setting.tree,
        "kld_mean": scores.get("kld_mean"),
        "kld_median": scores.get("kld_median"),
        "kld_p99": scores.get("kld_p99"),
        "top1_agreement": scores.get("top1_agreement"),
        "perplexity": scores.get("perplexity"),
        "quality_tokens": scores.get("tokens", 0),
        "task_pass_rate": rate("all"),
        "task_pass_rate_code": rate("code"),
        "task_pass_rate_math": rate("math"),
        "decode_speedup": aggregate["speedup"],
        "decode_speedup_interval": aggregate.get("speedup_interval"),  # 95%, over prompts
        "e2e_speedup": aggregate["e2e_speedup"],
        "tokens_per_s": aggregate["tokens_per_s"],
        "decode_tokens_per_s": aggregate["decode_tokens_per_s"],
        "memory_bytes": aggregate["peak_memory_bytes"],
        "lossless_to": job.variant,
        "identical": aggregate["identical"] if job.speculative and not sampled else None,
        "compared": aggregate["compared"] if job.speculative and not sampled else None,
        "acceptance_rate": aggregate.get("acceptance_rate"),
        "mean_acceptance_length": aggregate.get("mean_acceptance_length"),
        "prompts": aggregate["prompts"],
        "new_tokens": aggregate["new_tokens"],
        "params": structure.get("params"),
        "layers": structure.get("layers"),
        "intermediate_size": structure.get("intermediate_size"),
    }
