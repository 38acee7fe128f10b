"""Training an EAGLE-style head (models/eagle_head.py) on the target's own answers.

The data are the distillation's answers (distill/data.py): each prompt + answer runs once through
the target, whose caches then keep its features (cache.keep_features): f_j for every position,
exactly what decoding will hand the head. The head learns, at every position j, to predict
f_{j+1} from f_j and the embedding of t_{j+1}: a regression on the feature (smooth L1) plus the
cross-entropy of its next-token distribution against the target's (both through the target's
output layer over the draft vocabulary), weighted as EAGLE does (1 and 0.1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdecode.core.cache import keep_features
from specdecode.core.draft_spec import DEFAULT_DRAFT_VOCAB
from specdecode.core.measure import peak_memory
from specdecode.distill.data import Answer
from specdecode.distill.settings import DistillSettings
from specdecode.distill.train import (
    EVAL_ANSWERS,
    Checkpoints,
    answers_digest,
    autocast_context,
    autocast_dtype,
    train,
    training_record,
)
from specdecode.models.adapters import vocab_digest
from specdecode.models.eagle_head import EagleHead, target_fingerprint, write_head
from specdecode.models.lean import target_cache
from specdecode.models.loading import load_model

CLS_WEIGHT = 0.1  # EAGLE's weight of the token loss against the feature regression


@dataclass
class FeatureAnswer:
    """One prompt + answer with the target's features at every position."""

    ids: torch.Tensor  # [T] int64: prompt then answer
    features: torch.Tensor  # [T, D] in the target's dtype
    start: int  # the first answer position
    key: str = ""

    @property
    def first(self) -> int:
        """The first head position trained: the head at j predicts t_{j+2}, and decoding
        drafts from the answer's second token on (the prefill commits the first)."""
        return max(0, self.start - 1)

    @property
    def tokens(self) -> int:
        """Positions trained on: the answer's (the prompt's are context only)."""
        return int(self.ids.shape[0]) - 1 - self.first


def target_features(target: Any, new_cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """The target's features over `ids` [T]: [T, D] (one forward through a fresh cache made by
    `new_cache(target)`, as decoding makes them; the target must keep features). A plain
    tensor, not an inference one: training reads it under autograd."""
    cache = new_cache(target)
    try:
        with torch.inference_mode():
            # (the embedding's device: a 4-bit target's first weights may be freed, on meta)
            device = target.get_input_embeddings().weight.device
            cache.forward(ids.to(device), last_only=True)
            features = cache.features()
        return features.clone()
    finally:
        close = getattr(cache, "close", None)
        if close is not None:
            close()


def feature_answers(
    target: Any, new_cache: Any, answers: Sequence[Answer], progress: bool = True
) -> list[FeatureAnswer]:
    """Every answer with the target's features over prompt + answer."""
    out = []
    for answer in tqdm(answers, desc="target features", unit="answer", disable=not progress):
        ids = torch.cat([answer.prompt_ids, answer.answer_ids]).long()
        features = target_features(target, new_cache, ids)
        out.append(FeatureAnswer(ids, features, int(answer.prompt_ids.numel()), answer.key))
    return out


def sequence_loss(
    head: EagleHead,
    embed: torch.Tensor,  # [V, D] the target's input embedding
    item: FeatureAnswer,
    autocast: torch.dtype | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The head's loss summed over one sequence's answer positions (`item.first` on), and its
    parts per position: feature regression, token cross-entropy, top-1 agreement. The prompt's
    positions run through the head too (the answer's attend to them) but are not scored."""
    assert head.output is not None, "attach_output first"
    feats = item.features.float()
    device = feats.device
    n, first = int(item.ids.shape[0]) - 1, item.first
    goal = feats[first + 1 :]  # [m, D]: f_{j+1}
    with autocast_context(device, autocast):
        pred = head(embed[item.ids[1:]].float(), feats[:-1], torch.arange(n, device=device))
        pred = pred[first:]  # [m, D]
        logq = head.output.inner(pred).float().log_softmax(-1)  # [m, V']
    pred = pred.float()
    reg = F.smooth_l1_loss(pred, goal, reduction="none").mean(-1)  # [m]
    with torch.no_grad():
        p_target = head.output.inner(goal).softmax(-1)  # [m, V'] the target's, kept ids
    cls = -(p_target * logq).sum(-1)  # [m]
    agree = (logq.argmax(-1) == p_target.argmax(-1)).float().mean()
    loss = (reg + CLS_WEIGHT * cls).sum()
    parts = {
        "reg": float(reg.mean().detach()),
        "cls": float(cls.mean().detach()),
        "top1": float(agree),
    }
    return loss, parts


def head_step(
    head: EagleHead,
    embed: torch.Tensor,
    autocast: torch.dtype | None,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[FeatureAnswer],
) -> float:
    """One optimizer step on `batch`; its loss per position (gradients clipped to norm 1)."""
    optimizer.zero_grad(set_to_none=True)
    positions = sum(item.tokens for item in batch)
    total = 0.0
    for item in batch:
        loss, _ = sequence_loss(head, embed, item, autocast)
        (loss / positions).backward()
        total += float(loss.detach()) / positions
    torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return total


@torch.no_grad()
def evaluate(
    head: EagleHead, embed: torch.Tensor, items: Sequence[FeatureAnswer]
) -> dict[str, float]:
    """The loss parts per position over `items` (no training)."""
    sums = {"reg": 0.0, "cls": 0.0, "top1": 0.0}
    positions = 0
    for item in items:
        _, parts = sequence_loss(head, embed, item)
        for key in sums:
            sums[key] += parts[key] * item.tokens
        positions += item.tokens
    return {key: round(value / max(1, positions), 4) for key, value in sums.items()}


def distill_head(
    settings: DistillSettings,
    answers: Sequence[Answer],
    out: Path,
    device: torch.device,
    record: dict[str, Any],
    run_started: float,
    progress: bool = True,
) -> dict[str, Any]:
    """Train an EAGLE-style head for `settings.target` on `answers`, write DIR/head.safetensors
    and DIR/eagle.json; the record written (`run_started`: the run's perf_counter start)."""
    started = time.perf_counter()
    loaded = load_model(settings.target, dtype=settings.dtype, device=device, role="target")
    target = loaded.model
    keep_features(target)
    items = feature_answers(target, target_cache, answers, progress)
    feature_s = time.perf_counter() - started

    head = EagleHead.from_target(target).to(device)
    head.attach_output(target, DEFAULT_DRAFT_VOCAB, loaded.tokenizer)
    assert head.output is not None
    head.output.float()
    embed = target.get_input_embeddings().weight.detach()  # [V, D], read per batch
    autocast = autocast_dtype(settings, device)
    evaluated = items[:EVAL_ANSWERS]
    before = evaluate(head, embed, evaluated)
    key = {
        **settings.train_key(),
        "answers": answers_digest(answers),
        "target": record["target"],
    }
    checkpoints = Checkpoints(
        out / "checkpoints",
        key,
        weights=lambda model: model.trained_state(),
        load_weights=lambda model, weights: model.load_state_dict(weights, strict=False),
    )

    def one_step(optimizer: torch.optim.Optimizer, batch: Sequence[Any]) -> float:
        return head_step(head, embed, autocast, optimizer, batch)

    state = train(head, items, settings, 0, device, checkpoints, progress, one_step=one_step)
    after = evaluate(head, embed, evaluated)
    record.update(
        kind="eagle",
        target_config=target_fingerprint(target),
        tokenizer=vocab_digest(loaded.tokenizer),
        head={
            "layers": 1,
            "trained_parameters": sum(p.numel() for p in head.trained_state().values()),
            "train_vocab": int(head.output.keep.numel()),
        },
        training={
            "loss": f"smooth L1 on the feature + {CLS_WEIGHT} x cross-entropy on the token",
            **training_record(settings, state, device, autocast),
            "before": before,
            "after": after,
            "eval_answers": len(evaluated),
        },
    )
    record.setdefault("time", {})["features_s"] = round(feature_s, 3)
    record["time"]["this_run_s"] = round(time.perf_counter() - run_started, 3)
    record.setdefault("peak_memory", {})["after_training"] = peak_memory(device)
    write_head(out, head, record)
    return record
