"""`run_distill`: one distillation from settings to DIR/adapter + DIR/distill.json.

1. Prompts: the suite's training prompts (its held-out ones set aside), plus self-written ones.
2. Data (data.py): the target answers them, cached in DIR/data; skipped, with no model loaded,
   when everything is cached already.
3. Training (train.py): the base draft in float32 with LoRA adapters, on the cached answers
   only (the target is freed first), resumed from DIR/checkpoints.
4. Result (result.py): the adapter and its record, written so only a finished run loads.
"""

from __future__ import annotations

import gc
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import transformers

from specdecode.core.draft_spec import ModelSpec
from specdecode.core.measure import peak_memory
from specdecode.distill.data import AnswerStore, Planned, make_answers, plan_answers
from specdecode.distill.eagle import distill_head
from specdecode.distill.prompts import (
    DistillPrompt,
    cached_self_prompts,
    self_prompts,
    suite_prompts,
)
from specdecode.distill.result import write_result
from specdecode.distill.settings import DistillSettings
from specdecode.distill.train import (
    EVAL_ANSWERS,
    Checkpoints,
    Interrupted,
    add_lora,
    answers_digest,
    autocast_dtype,
    autocast_probe,
    keep_freed_memory,
    mean_loss,
    train,
    training_record,
)
from specdecode.models.adapters import draft_fingerprint, peft_modules, vocab_digest
from specdecode.models.compat import common_vocab_size
from specdecode.models.device import resolve_device
from specdecode.models.loading import load_model
from specdecode.runtime.engine import SpeculativeDecoder

GENERATION_K = 4  # the chain the untrained draft speeds one answer at a time up with


def portable(name: str) -> str:
    """A model's name as the record keeps it: a local path made absolute (the :int8 / :int4
    suffix kept), anything else as given."""
    spec = ModelSpec.parse(name)
    path = Path(spec.name).expanduser()
    if not path.exists():
        return name
    return str(ModelSpec(str(path.resolve()), spec.quantization))


def _vocab(target: Any, draft: Any) -> int:
    try:
        return common_vocab_size(target, draft)
    except ValueError as err:
        raise ValueError(
            f"{draft.name} cannot be distilled for {target.name} (distilling needs the "
            f"target's tokenizer): {err}"
        ) from None


def _check_chat(target: Any, chat: bool) -> None:
    if target.tokenizer is None:
        raise ValueError(f"the target {target.name} has no tokenizer: distill answers text prompts")
    if chat and getattr(target.tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the target {target.name}'s tokenizer has no chat template: use --no-chat"
        )


def run_distill(
    settings: DistillSettings, *, progress: bool = True, command: str = ""
) -> dict[str, Any]:
    """Distil `settings.draft` for `settings.target`; the record written to DIR/distill.json.
    ValueError for bad input, Interrupted on Ctrl-C (state kept), store.DiskFull for a full disk."""
    settings.validate()
    if settings.kind == "lora":
        peft_modules()  # missing peft fails before anything is loaded (a head needs none)
    started = time.perf_counter()
    out = Path(settings.out).expanduser()
    device = resolve_device(settings.device)
    train_prompts, held_out = suite_prompts(settings.prompts, settings.categories, settings.holdout)
    draft_spec = ModelSpec.parse(settings.draft, "draft")
    store = AnswerStore(out / "data", {**settings.data_key(), "target": portable(settings.target)})

    data_start = time.perf_counter()
    planned, self_report, made = _answer(settings, store, train_prompts, device, progress)
    data_s = time.perf_counter() - data_start
    data_peak = peak_memory(device)
    models = store.models or {}
    vocab = int(models["vocab"])
    answers = store.load([p.key for p in planned])
    keep_freed_memory(device)  # training's speed on a CPU (train.py)
    if settings.kind == "eagle":
        record = _record(settings, command)
        record["data"] = _data_record(settings, train_prompts, held_out, answers, self_report, made)
        record["time"] = {"data_s": round(data_s, 3)}
        record["peak_memory"] = {"after_data": data_peak}
        return distill_head(settings, answers, out, device, record, started, progress)

    draft = load_model(draft_spec.name, dtype="float32", device=device, kernel="off", role="draft")
    if draft.tokenizer is not None and vocab_digest(draft.tokenizer) != models["tokenizer"]:
        raise ValueError(
            f"{settings.draft}'s tokenizer is not the target's (the one the answers cached in "
            f"{store.dir} were made with): a draft must share its target's tokenizer"
        )
    fingerprint = draft_fingerprint(draft.model)
    model = add_lora(draft.model, settings.lora_rank, settings.alpha, settings.seed)
    dtype = autocast_dtype(settings, device)
    evaluated = answers[:EVAL_ANSWERS]
    loss_before = mean_loss(model, evaluated, vocab, settings.loss, device, dtype)
    key = {**settings.train_key(), "answers": answers_digest(answers), "vocab": vocab}
    state = train(
        model, answers, settings, vocab, device, Checkpoints(out / "checkpoints", key), progress
    )
    loss_after = mean_loss(model, evaluated, vocab, settings.loss, device, dtype)
    train_peak = peak_memory(device)

    record = _record(settings, command)
    record.update(
        draft=portable(draft_spec.name),
        draft_config=fingerprint,
        tokenizer=models["tokenizer"],
        vocab=vocab,
        adapter={"rank": settings.lora_rank, "alpha": settings.alpha, "modules": "all-linear"},
        data=_data_record(settings, train_prompts, held_out, answers, self_report, made),
        training={
            "loss": settings.loss,
            **training_record(settings, state, device, dtype),
            "autocast_probe_ms": autocast_probe(device) if settings.autocast == "auto" else None,
            "loss_before": loss_before,
            "loss_after": loss_after,
            "eval_answers": len(evaluated),
        },
        time={"data_s": round(data_s, 3), "this_run_s": round(time.perf_counter() - started, 3)},
        peak_memory={"after_data": data_peak, "after_training": train_peak},
    )
    write_result(out, model, record)
    return record


def _answer(
    settings: DistillSettings,
    store: AnswerStore,
    train_prompts: list[DistillPrompt],
    device: torch.device,
    progress: bool,
) -> tuple[list[Planned], dict[str, Any] | None, int]:
    """The answers training needs, made where missing: (every planned answer, what writing
    prompts took this run, answers made this run). With everything cached, no model is loaded."""
    temperatures, samples = settings.temperatures, settings.samples
    written = cached_self_prompts(store.dir, train_prompts, settings.self_prompts or 0)
    planned = plan_answers(train_prompts + (written or []), temperatures, samples)
    missing = {p.key for p in planned} - store.done()
    if written is not None and store.models is not None and not missing:
        return planned, None, 0
    target = load_model(settings.target, dtype=settings.dtype, device=device, role="target")
    _check_chat(target, settings.chat)
    draft_spec = ModelSpec.parse(settings.draft, "draft")
    helper = load_model(
        draft_spec, dtype=settings.dtype, device=device, keep_weights=True, role="draft"
    )
    vocab = _vocab(target, helper)
    store.set_models({"vocab": vocab, "tokenizer": vocab_digest(target.tokenizer)})
    # rows > 1: the answers are batched, by the target alone (a batch's target forward over
    # many rows costs little more than over one; a draft would add its forwards to each step)
    drafter = helper if settings.rows == 1 else None
    engine = SpeculativeDecoder(
        target, drafter, k=GENERATION_K, k_policy="fixed", generation_config="none"
    )
    report = None
    try:
        if settings.self_prompts:
            written, report = self_prompts(
                engine,
                train_prompts,
                settings.self_prompts,
                store.dir,
                settings.chat,
                settings.max_new_tokens,
                progress,
                settings.rows,
            )
            planned = plan_answers(train_prompts + written, temperatures, samples)
        made = make_answers(
            engine,
            planned,
            store,
            vocab,
            settings.top_k,
            settings.max_new_tokens,
            settings.chat,
            progress,
            settings.rows,
        )
    except KeyboardInterrupt:
        have = len({p.key for p in planned} & store.done())
        raise Interrupted(
            f"interrupted while the target answered: {have} of {len(planned)} answers are "
            f"cached in {store.dir}. Run the same command again to continue from them"
        ) from None
    del engine, target, helper
    gc.collect()
    return planned, report, made


def _record(settings: DistillSettings, command: str) -> dict[str, Any]:
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if settings.kind == "lora":
        versions["peft"] = peft_modules().__version__
    return {
        "target": portable(settings.target),
        "command": command or " ".join(sys.argv),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "settings": settings.to_dict(),
        "versions": versions,
    }


def _data_record(settings, train_prompts, held_out, answers, self_report, made) -> dict[str, Any]:
    per_category: dict[str, dict[str, int]] = {}
    for answer in answers:
        row = per_category.setdefault(answer.category, {"answers": 0, "tokens": 0})
        row["answers"] += 1
        row["tokens"] += answer.tokens
    prompts_per_category = Counter(c for c, _ in {(a.category, a.prompt_id) for a in answers})
    for category, row in per_category.items():
        row["prompts"] = prompts_per_category.get(category, 0)
    return {
        "source": str(Path(settings.prompts).resolve()) if settings.prompts else None,
        "categories": settings.categories,
        "holdout": settings.holdout,
        "train_prompt_ids": [p.id for p in train_prompts],
        "self_prompt_ids": sorted({a.prompt_id for a in answers} - {p.id for p in train_prompts}),
        "heldout_prompt_ids": [p.id for p in held_out],
        "self_prompts": self_report
        or ({"per_category": settings.self_prompts} if settings.self_prompts else None),
        "temperatures": settings.temperatures,
        "samples": settings.samples,
        "top_k": settings.top_k,
        "max_new_tokens": settings.max_new_tokens,
        "chat": settings.chat,
        "rows": settings.rows,
        "answers": len(answers),
        "tokens": sum(a.tokens for a in answers),
        "made_this_run": made,
        "per_category": per_category,
    }
