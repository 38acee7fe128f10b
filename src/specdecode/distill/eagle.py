"""Training an EAGLE-3 head (models/eagle_head.py) on the target's own answers.

The data are the distillation's answers (distill/data.py): each prompt + answer runs once through
the target, whose caches then keep its features (cache.keep_features) at the three hidden states
the head reads and after the final norm: exactly what decoding hands the head, and the target's
own next-token distribution. The head learns, at every position j, the target's distribution of
t_{j+2} from the target's states at j and the token t_{j+1} (cross-entropy over the draft
vocabulary), and, as EAGLE-3's training-time test does, the same from its own output in place of
the target's states, TTT_STEPS - 1 steps further (each step's loss weighted TTT_DECAY times the
one before): what drafting a chain asks of it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
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
from specdecode.kernels.quantize import is_quantized, quantized_weights
from specdecode.models.adapters import vocab_digest
from specdecode.models.draft_vocab import kept_ids
from specdecode.models.eagle_head import Eagle3Head, HeadShape, write_head
from specdecode.models.lean import target_cache
from specdecode.models.loading import load_model

TTT_STEPS, TTT_DECAY = 3, 0.8  # the chain length trained and each step's weight against the last
# the target config fields the head's decoder layer copies
LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)


@dataclass
class FeatureAnswer:
    """One prompt + answer with the target's features at every position."""

    ids: torch.Tensor  # [T] int64: prompt then answer
    features: torch.Tensor  # [T, 3D + D]: the head's three states, then the final norm's
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
    """The target's features over `ids` [T]: [T, W] (one forward through a fresh cache made by
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


def training_layers(layers: int) -> tuple[int, int, int]:
    """The hidden states a head trained here reads on a target of `layers` layers: EAGLE-3's
    2, L // 2 and L - 3, kept inside a small target's layers."""
    return tuple(sorted(min(max(i, 0), layers - 1) for i in (2, layers // 2, layers - 3)))  # type: ignore[return-value]


def new_head(target: Any, aux: tuple[int, ...], keep: torch.Tensor, name: str) -> Eagle3Head:
    """A head to train for `target` (float32), drafting the ids `keep` [V'] (increasing): its
    layer started from the target's last layer (the attention reading the embedding at half
    weight beside the states), fc passing the highest state, norm and lm_head the target's."""
    config = target.config
    layer = {k: getattr(config, k) for k in LAYER_FIELDS if getattr(config, k, None) is not None}
    vocab = int(target.get_input_embeddings().weight.shape[0])
    shape = HeadShape(
        layer={**layer, "vocab_size": vocab},
        draft_vocab=int(keep.numel()),
        target_vocab=vocab,
        target_hidden=int(config.hidden_size),
        aux_layers=aux,
        norm_before_residual=False,
        verifier=name,
    )
    head = Eagle3Head(shape, aux, own_embedding=False).float()
    base = target.get_decoder()
    last = base.layers[-1]
    hidden = int(config.hidden_size)
    with torch.no_grad():
        mine = head.layers[0]
        for part in ("q_proj", "k_proj", "v_proj"):
            weight = _weight(getattr(last.self_attn, part))  # [out, D]
            getattr(mine.self_attn, part).weight.copy_(torch.cat([weight / 2, weight], dim=1))
        mine.self_attn.o_proj.weight.copy_(_weight(last.self_attn.o_proj))
        for part in ("gate_proj", "up_proj", "down_proj"):
            getattr(mine.mlp, part).weight.copy_(_weight(getattr(last.mlp, part)))
        for norm in ("input_layernorm", "hidden_norm"):
            getattr(mine, norm).weight.copy_(last.input_layernorm.weight.float())
        mine.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
        head.norm.weight.copy_(base.norm.weight.float())
        head.fc.weight.zero_()
        head.fc.weight[:, -hidden:] = torch.eye(hidden)
        head.lm_head.weight.copy_(output_weight(target)[keep.to(head.d2t.device)].float())
        head.d2t.copy_(keep - torch.arange(keep.numel()))
    head.lm_head.requires_grad_(False)  # the target's rows, as drafting reads them
    return head


def trained_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """What training changes: fc, the layer and the final norm."""
    return {
        name: tensor
        for name, tensor in head.state_dict().items()
        if name.startswith(("fc.", "layers.", "norm."))
    }


def sequence_loss(
    head: Eagle3Head,
    embed: torch.Tensor,  # [V, D] the target's input embedding
    target_rows: torch.Tensor,  # [V', D] float32: the target's output layer over the draft ids
    item: FeatureAnswer,
    autocast: torch.dtype | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The head's loss summed over one sequence's answer positions (`item.first` on) and its
    TTT_STEPS chain steps, and its parts per position at the first step: token cross-entropy
    and top-1 agreement with the target. The prompt's positions run through the head too (the
    answer's attend to them) but are not scored."""
    feats = item.features.float()
    device = feats.device
    width = len(head.aux_layers) * head.shape.target_hidden
    aux, final = feats[:-1, :width], feats[1:, width:]  # [n, 3D], [n, D]: the goal at j + 1
    n, first = int(item.ids.shape[0]) - 1, item.first
    with torch.no_grad():
        p_target = (final[first:] @ target_rows.T).softmax(-1)  # [m, V'] the target's
    attn = head.layers[0].self_attn
    rows = torch.arange(n, device=device)[:, None]  # query j
    cols = torch.arange(n, device=device)[None, :]  # key i
    embeds = embed[item.ids[1:]].float()  # [n, D]: t_{j+1}
    cos, sin = head.rope(torch.arange(n, device=device))
    total = torch.zeros((), device=device)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    hidden, parts = aux, {}
    with autocast_context(device, autocast):
        for step in range(TTT_STEPS):
            x, residual = head.step_in(embeds, hidden, from_target=step == 0)
            q, k, v = attn.project(x, cos.float(), sin.float())
            keys.append(k)
            values.append(v)
            # query j of chain step s started at j - s: the target-fed keys up to there, then
            # its own chain's key at each step since (the diagonal), as drafting sees them
            start = rows - step
            masks = [cols <= start.clamp(min=0)] + [cols == start + r for r in range(1, step + 1)]
            allowed = torch.cat(masks, dim=1)  # [n, (step + 1) n]
            out = attn.attend(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), allowed)
            h = head.step_out(residual, out)  # [n, D]
            logq = head.draft_logits(h)[first:].log_softmax(-1)  # [m, V']
            scored = (torch.arange(first, n, device=device) >= step).float()  # chains that began
            cls = -(p_target * logq).sum(-1) * scored  # [m]
            total = total + TTT_DECAY**step * cls.sum()
            if step == 0:
                agree = (logq.argmax(-1) == p_target.argmax(-1)).float().mean()
                parts = {"cls": float(cls.mean().detach()), "top1": float(agree)}
            # the next step reads at j the head's output at j - 1 (nothing before position 0)
            hidden = torch.cat([h.new_zeros(1, h.shape[1]), h[:-1]])
    return total, parts


def head_step(
    head: Eagle3Head,
    embed: torch.Tensor,
    target_rows: torch.Tensor,
    autocast: torch.dtype | None,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[FeatureAnswer],
) -> float:
    """One optimizer step on `batch`; its loss per position (gradients clipped to norm 1)."""
    optimizer.zero_grad(set_to_none=True)
    positions = sum(item.tokens for item in batch)
    total = 0.0
    for item in batch:
        loss, _ = sequence_loss(head, embed, target_rows, item, autocast)
        (loss / positions).backward()
        total += float(loss.detach()) / positions
    torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    return total


@torch.no_grad()
def evaluate(
    head: Eagle3Head,
    embed: torch.Tensor,
    target_rows: torch.Tensor,
    items: Sequence[FeatureAnswer],
) -> dict[str, float]:
    """The first step's loss parts per position over `items` (no training)."""
    sums = {"cls": 0.0, "top1": 0.0}
    positions = 0
    for item in items:
        _, parts = sequence_loss(head, embed, target_rows, item)
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
    """Train an EAGLE-3 head for `settings.target` on `answers`, write DIR/config.json,
    DIR/model.safetensors and DIR/eagle.json; the record written (`run_started`: the run's
    perf_counter start)."""
    started = time.perf_counter()
    loaded = load_model(settings.target, dtype=settings.dtype, device=device, role="target")
    target = loaded.model
    layers = len(target.get_decoder().layers)
    aux = training_layers(layers)
    keep_features(target, (*aux, layers))  # the head's states, then the target's distribution
    items = feature_answers(target, target_cache, answers, progress)
    feature_s = time.perf_counter() - started

    vocab = int(target.get_input_embeddings().weight.shape[0])
    configs = [getattr(target, name, None) for name in ("config", "generation_config")]
    keep = kept_ids(vocab, DEFAULT_DRAFT_VOCAB, loaded.tokenizer, configs).cpu()
    head = new_head(target, aux, keep, record["target"]).to(device)
    target_rows = head.lm_head.weight.detach().clone()  # [V', D] the target's, frozen
    embed = target.get_input_embeddings().weight.detach()  # [V, D], read per batch
    autocast = autocast_dtype(settings, device)
    evaluated = items[:EVAL_ANSWERS]
    before = evaluate(head, embed, target_rows, evaluated)
    key = {
        **settings.train_key(),
        "answers": answers_digest(answers),
        "target": record["target"],
    }
    checkpoints = Checkpoints(
        out / "checkpoints",
        key,
        weights=trained_state,
        load_weights=lambda model, weights: model.load_state_dict(weights, strict=False),
    )

    def one_step(optimizer: torch.optim.Optimizer, batch: Sequence[Any]) -> float:
        return head_step(head, embed, target_rows, autocast, optimizer, batch)

    state = train(head, items, settings, 0, device, checkpoints, progress, one_step=one_step)
    after = evaluate(head, embed, target_rows, evaluated)
    record.update(
        kind="eagle",
        tokenizer=vocab_digest(loaded.tokenizer),
        head={
            "layout": "speculators eagle3",
            "reads_hidden_states": list(aux),
            "trained_parameters": sum(p.numel() for p in trained_state(head).values()),
            "draft_vocab": int(keep.numel()),
        },
        training={
            "loss": (
                f"cross-entropy on the target's next token over {TTT_STEPS} chain steps "
                f"(training-time test, each step x{TTT_DECAY} the last)"
            ),
            **training_record(settings, state, device, autocast),
            "before": before,
            "after": after,
            "eval_answers": len(evaluated),
        },
    )
    record.setdefault("time", {})["features_s"] = round(feature_s, 3)
    record["time"]["this_run_s"] = round(time.perf_counter() - run_started, 3)
    record.setdefault("peak_memory", {})["after_training"] = peak_memory(device)
    weights = target.get_input_embeddings().weight.dtype  # the target's (a 4-bit one's: bf16)
    write_head(out, head, record["target"], record, weights)
    return record


def output_weight(target: Any) -> torch.Tensor:
    """The target's output layer weight [V, D] as a plain tensor: its own, or (a tied output
    layer whose weight a quantized target freed) the input embedding, or dequantized codes."""
    head = target.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is not None and not weight.is_meta:
        return weight.detach()
    embed = target.get_input_embeddings().weight
    if getattr(target.config, "tie_word_embeddings", False) and not embed.is_meta:
        return embed.detach()
    return quantized_weights(head)


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear's weight as float32 (a quantized target's dequantized)."""
    weight = getattr(module, "weight", None)
    if weight is None or weight.is_meta or is_quantized(module):
        weight = quantized_weights(module)
    return weight.detach().float()
