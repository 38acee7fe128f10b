"""`specdecode bench`: every requested method on the same prompts, in one process, interleaved.

Order of work: load the prompts and models, plan the settings, warm every setting up, then for
each repeat and prompt run every setting (in an order rotated per prompt, so drift and cache
effects hit all alike), writing each record to results.jsonl as soon as it exists (an interrupted
run keeps what it measured). Greedy outputs are checked against `ar` for every prompt.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from tqdm import tqdm

from specdecode.bench.aggregate import summarize
from specdecode.bench.memory import decode_bytes, estimate_bytes
from specdecode.bench.methods import (
    ALL_METHODS,
    OUR_METHODS,
    MethodRunner,
    Setting,
    config_drafts,
    plan_settings,
    takes_prefill,
    tuned_setting,
)
from specdecode.bench.records import Record, make_record, mark_identity, top2_margin
from specdecode.bench.report import write_report
from specdecode.config import load_config
from specdecode.core.draft_spec import DraftSpec, ModelSpec, resolve_draft_vocab
from specdecode.core.policies import K_POLICIES
from specdecode.data.suites import (
    WARM_UP,
    WARM_UP_TOKENS,
    BenchPrompt,
    interleave_by_category,
    load_suite,
)
from specdecode.drafters import resolve_draft
from specdecode.drafters.tree_shape import parse_tree_spec
from specdecode.models.loading import LoadedModel, load_model

QUICK_TARGET = "smollm2-135m-instruct"
QUICK_DRAFTS = ["ngram"]  # no smaller sibling shares its tokenizer here
RESULTS, SUMMARY, REPORT, RUN = "results.jsonl", "summary.json", "report.md", "run.json"


@dataclass
class BenchConfig:
    target: str
    drafts: list[str] = field(default_factory=list)
    methods: list[str] | None = None  # None: every method that applies
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 6, 8])
    policies: list[str] = field(default_factory=lambda: ["cost"])
    trees: list[str] = field(default_factory=list)  # token-tree shapes, for model drafts
    hf_ks: list[int] | None = None  # k of HF's constant-k settings (None: the same as ks)
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    max_new_tokens: int = 64
    prompts_file: str | None = None
    categories: list[str] | None = None
    limit: int | None = None
    turns: str = "first"  # "first" or "all"
    chat: bool = True
    repeats: int = 1
    # prefill each prompt once and hand a copy of the cache to every method that can take one
    # (methods.takes_prefill); their TTFT and e2e rates then exclude the target's prefill
    share_prefill: bool = False
    dtype: str = "bfloat16"
    device: str | None = None
    # a run config (`specdecode tune` writes one): benchmarked as the setting `spec[tuned]`,
    # each prompt category with its own drafter, k, policy or tree
    config_file: str | None = None
    out: str = "runs/bench"
    command: str = ""  # the command line, written with the results

    def validate(self) -> None:
        if self.turns not in ("first", "all"):
            raise ValueError(f"--turns is 'first' or 'all' (got {self.turns!r})")
        if self.turns == "all" and not self.chat:
            raise ValueError("--turns all plays conversations: it needs --chat")
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (got {self.limit})")
        for name, ks in (("--k", self.ks), ("--hf-k", self.hf_ks)):
            if ks is not None and (not ks or any(k < 1 for k in ks)):
                raise ValueError(f"{name} takes look-aheads >= 1 (got {ks})")

        ModelSpec.parse(self.target, "target")  # `MODEL[:int8|:int4]`: the `ar` reference

        for policy in self.policies:
            if policy not in K_POLICIES:
                raise ValueError(
                    f"unknown k policy {policy!r}: choose from {', '.join(K_POLICIES)}"
                )
        for draft in self.drafts:
            DraftSpec.parse(draft)  # a bad spec fails before any model is loaded
        for tree in self.trees:
            parse_tree_spec(tree)
        if self.methods is not None:
            unknown = [m for m in self.methods if m not in ALL_METHODS]
            if unknown:
                raise ValueError(
                    f"unknown method {unknown[0]!r}: choose from {', '.join(ALL_METHODS)}"
                )
            if "ar" not in self.methods:
                raise ValueError("every comparison needs the baseline: include `ar` in --methods")
            if "spec" in self.methods and not self.drafts:
                raise ValueError("method `spec` needs at least one --draft")


def default_methods(drafts: dict[str, Any]) -> list[str]:
    methods = ["ar", "hf-ar"]
    if drafts:
        methods.insert(1, "spec")
    if any(isinstance(d, LoadedModel) for d in drafts.values()):
        methods.append("hf-assisted")
    methods.append("hf-prompt-lookup")
    return methods


class _Conversation:
    """One setting's view of a prompt: its turns with its own answers in between."""

    def __init__(self, prompt: BenchPrompt) -> None:
        self.prompt = prompt
        self.messages: list[dict[str, str]] = []

    def next_input(self, turn: int, chat: bool) -> Any:
        if not chat:
            return self.prompt.turns[turn]
        self.messages.append({"role": "user", "content": self.prompt.turns[turn]})
        return list(self.messages)

    def answer(self, text: str | None) -> None:
        if self.messages:
            self.messages.append({"role": "assistant", "content": text or ""})


def load_bench_models(config: BenchConfig) -> tuple[LoadedModel, dict[str, Any]]:
    """The target and every draft of `config` (draft label -> what resolve_draft made of it)."""
    target = load_model(config.target, dtype=config.dtype, device=config.device, role="target")
    drafts = {
        spec: resolve_draft(spec, target, dtype=config.dtype, device=config.device)
        for spec in config.drafts
    }
    return target, drafts


def run_bench(config: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark described by `config`; write DIR/{results.jsonl,summary.json,...}."""
    config.validate()
    prompts = interleave_by_category(
        load_suite(config.prompts_file, categories=config.categories, limit=config.limit)
    )
    run = load_config(config.config_file) if config.config_file else None
    categories = list(dict.fromkeys(p.category for p in prompts))
    tuned = [tuned_setting(run)] if run else []
    named = list(dict.fromkeys([*config.drafts, *(config_drafts(run, categories) if run else [])]))
    target, drafts = load_bench_models(replace(config, drafts=named))
    planned = {label: drafts[label] for label in config.drafts}  # the config's run only tuned
    only_tuned = run is not None and not planned
    methods = config.methods or (["ar"] if only_tuned else default_methods(planned))
    settings = plan_settings(
        methods, planned, config.ks, config.policies, config.trees, config.hf_ks, target
    )
    _, summary = run_settings(config, target, drafts, settings + tuned, prompts, progress)
    return summary


def run_settings(
    config: BenchConfig,
    target: LoadedModel,
    drafts: dict[str, Any],
    settings: list[Setting],
    prompts: list[BenchPrompt],
    progress: bool = True,
) -> tuple[list[Record], dict[str, Any]]:
    """Run `settings` on `prompts` with loaded models; write and return records and summary."""
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    turns = _TurnRunner(config, target, drafts)
    _write_run_info(out_dir, config, settings, target)
    turns.warm_up(settings, prompts, progress)

    n_turns = sum(len(_turns_of(prompt, config)) for prompt in prompts)
    bar = tqdm(
        total=config.repeats * n_turns * len(settings),
        desc="bench",
        unit="run",
        disable=not progress,
    )
    with _ResultsWriter(out_dir / RESULTS) as results:
        for repeat, prompt, turn, order, conversations in _order_of_work(config, settings, prompts):
            done = turns.run(prompt, turn, repeat, order, conversations, bar)
            results.write([done[s] for s in settings])  # plan order, whatever the run order
    bar.close()
    records = results.records
    summary = summarize(records)
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    write_report(out_dir, summary, records, _read_run_info(out_dir))
    return records, summary


def _turns_of(prompt: BenchPrompt, config: BenchConfig) -> range:
    return range(len(prompt.turns)) if config.turns == "all" else range(1)


def _order_of_work(
    config: BenchConfig, settings: list[Setting], prompts: list[BenchPrompt]
) -> Iterator[tuple[int, BenchPrompt, int, list[Setting], dict[Setting, _Conversation]]]:
    """(repeat, prompt, turn, settings in their run order, each setting's conversation): per
    repeat, per prompt (the order rotated by the prompt's index, fresh conversations), per turn."""
    for repeat in range(config.repeats):
        for index, prompt in enumerate(prompts):
            conversations = {s: _Conversation(prompt) for s in settings}
            order = _rotate(settings, index)
            for turn in _turns_of(prompt, config):
                yield repeat, prompt, turn, order, conversations


class _TurnRunner:
    """Runs one turn of a prompt under every setting: the bench's unit of work."""

    def __init__(self, config: BenchConfig, target: LoadedModel, drafts: dict[str, Any]) -> None:
        self.config, self.target = config, target
        self.runner = MethodRunner(
            target,
            drafts,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            seed=config.seed,
        )
        self.engine = self.runner.ar_engine

    def prompt_ids(self, value: Any) -> list[int]:
        return self.engine.encode_prompt(value, chat=self.config.chat)

    def warm_up(self, settings: list[Setting], prompts: list[BenchPrompt], progress: bool) -> None:
        """Every setting (each tuned one as every category runs it) once, on a short generation,
        before anything is timed."""
        warm = self.prompt_ids(_Conversation(WARM_UP).next_input(0, self.config.chat))
        running = dict.fromkeys(s.for_category(p.category) for s in settings for p in prompts)
        for setting in tqdm(running, desc="warm-up", disable=not progress, leave=False):
            self.runner.run(setting, warm, min(WARM_UP_TOKENS, self.config.max_new_tokens))

    def run(
        self,
        prompt: BenchPrompt,
        turn: int,
        repeat: int,
        order: list[Setting],
        conversations: dict[Setting, _Conversation],
        bar: Any,
    ) -> dict[Setting, Record]:
        """Turn `turn` of `prompt` under every setting, in `order`; greedy records are marked
        against `ar`. Returns the records by setting."""
        done: dict[Setting, Record] = {}
        ids_of: dict[Setting, list[int]] = {}
        shared: dict[tuple[int, ...], tuple[Any, float]] = {}  # ids -> prefilled cache, s
        for setting in order:
            bar.set_postfix_str(f"{prompt.id} {setting.label}", refresh=False)
            done[setting], ids_of[setting] = self.one(
                prompt, turn, repeat, setting, conversations[setting], shared
            )
            bar.update()
        if not self.config.temperature:
            _check_identity(self.target, done, ids_of)
        return done

    def one(
        self,
        prompt: BenchPrompt,
        turn: int,
        repeat: int,
        setting: Setting,
        conversation: _Conversation,
        shared: dict[tuple[int, ...], tuple[Any, float]],
    ) -> tuple[Record, list[int]]:
        """One prompt x setting x repeat (at one turn): its record and the prompt ids it ran on.
        With `share_prefill`, the first method that can take a prefilled cache fills `shared`."""
        config, runner = self.config, self.runner
        runs = setting.for_category(prompt.category)  # itself unless tuned
        ids = self.prompt_ids(conversation.next_input(turn, config.chat))
        prefilled, prefill_s = None, None
        if config.share_prefill and takes_prefill(runs):
            if tuple(ids) not in shared:
                shared[tuple(ids)] = runner.prefill(ids)
            prefilled, prefill_s = shared[tuple(ids)]
        memory_source = _reset_peak(self.target)
        out = runner.run(runs, ids, config.max_new_tokens, prefilled)
        memory = _peak_or_estimate(self.target, runner, runs, len(ids) + len(out.token_ids))
        conversation.answer(_decode(self.engine, out.token_ids))
        record = make_record(
            prompt,
            turn,
            repeat,
            runs,
            ids,
            out,
            dtype=config.dtype,
            temperature=config.temperature,
            memory_bytes=memory,
            memory_source=memory_source,
            shared_prefill_s=prefill_s,
            target=config.target,
        )
        if setting.per_category:  # one column for the tuned config
            record.setting, record.tuned, record.ran = setting.label, True, runs.label
        return record, ids


class _ResultsWriter:
    """results.jsonl, written as the records come (an interrupted run keeps what it measured)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[Record] = []

    def __enter__(self) -> _ResultsWriter:
        self.file = self.path.open("w")
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def write(self, records: list[Record]) -> None:
        for record in records:
            self.file.write(json.dumps(record.to_dict()) + "\n")
            self.records.append(record)
        self.file.flush()


def _rotate(settings: list[Setting], by: int) -> list[Setting]:
    by %= len(settings)
    return settings[by:] + settings[:by]


def _decode(engine: Any, ids: list[int]) -> str | None:
    if engine.tokenizer is None:
        return None
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def _check_identity(
    target: LoadedModel, done: dict[Setting, Record], ids_of: dict[Setting, list[int]]
) -> None:
    """Mark every greedy record against `ar` of the same prompt; margins computed once."""
    ar_setting = next(s for s in done if s.method == "ar")
    ar_record = done[ar_setting]
    ar_record.identical_to_ar = True
    margins: dict[int, float] = {}

    def margin(position: int) -> float:
        if position not in margins:
            margins[position] = top2_margin(
                target.model, ids_of[ar_setting], ar_record.token_ids, position
            )
        return margins[position]

    for setting, record in done.items():
        # a different prompt (another setting's history in a conversation diverged earlier)
        # is not comparable: that divergence was recorded at its own turn
        if setting is not ar_setting and ids_of[setting] == ids_of[ar_setting]:
            mark_identity(ar_record, record, margin)


def _reset_peak(target: LoadedModel) -> str:
    """Start a new peak on CUDA; returns how this run's memory will be known."""
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
        torch.cuda.reset_peak_memory_stats(target.device)
        return "cuda max_memory_allocated"
    return "weights + key/value caches (computed)"


def _peak_or_estimate(
    target: LoadedModel, runner: MethodRunner, setting: Setting, n_tokens: int
) -> int:
    if target.device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(target.device))
    if setting.method in OUR_METHODS:
        drafter = runner.engine(setting).drafter if setting.method == "spec" else None
        return decode_bytes(target.model, drafter, n_tokens)
    draft_model = None  # Hugging Face's methods: every model through its own forward
    if setting.method == "hf-assisted":
        draft_model = runner.drafts[setting.draft].model
    return estimate_bytes(target.model, draft_model, n_tokens)


def _write_run_info(
    out_dir: Path, config: BenchConfig, settings: list[Setting], target: LoadedModel
) -> None:
    info = {
        "command": config.command or " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "config": asdict(config),
        "settings": [s.label for s in settings],
        "tuned": {c: v.label for s in settings for c, v in s.per_category},  # bench --config
        "run_config": load_config(config.config_file).to_dict() if config.config_file else None,
        "target_dtype": str(target.dtype),
        "kernel": target.kernel,  # which path its linears run on (kernels/cpu.py)
        # ids a draft model's output layer computes (models/draft_vocab.py); None: every id
        "draft_vocab": resolve_draft_vocab(None),
        "attention": getattr(target.model.config, "_attn_implementation", None),
        "device": str(target.device),
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    (out_dir / RUN).write_text(json.dumps(info, indent=1))


def _read_run_info(out_dir: Path) -> dict[str, Any]:
    path = out_dir / RUN
    return json.loads(path.read_text()) if path.exists() else {}


def load_results(out_dir: str | Path) -> list[Record]:
    """The records of a saved run (results.jsonl), with a clear error when there are none."""
    path = Path(out_dir) / RESULTS
    if not path.exists():
        raise ValueError(f"{path} does not exist: run `specdecode bench --out {out_dir}` first")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
            if not isinstance(data, dict):
                raise ValueError(f"{path}:{number}: not a record (a JSON object)")
            records.append(Record.from_dict(data))
    if not records:
        raise ValueError(f"{path} holds no records")
    return records


def rerender(out_dir: str | Path) -> dict[str, Any]:
    """`specdecode report DIR`: aggregates and report again from the saved records."""
    out_dir = Path(out_dir)
    records = load_results(out_dir)
    summary = summarize(records)
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1))
    write_report(out_dir, summary, records, _read_run_info(out_dir))
    return summary
