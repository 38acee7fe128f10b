"""How close a variant's next-token distributions stay to the reference's, on the same text.

The statistics are those of llama.cpp's `llama-perplexity --kl-divergence`: over every token of
the reference text (teacher-forced: each model reads the same prompt and answer), at each
position where the answer's next token is predicted,

- KL(p_ref || p_variant) = sum_v p_ref(v) (log p_ref(v) - log p_variant(v)), in nats, of the raw
  next-token distributions (temperature 1, no top-k / top-p): mean, median and 99th percentile;
- top-1 agreement: the share of positions where both models' most probable token is the same;
- perplexity: exp(mean over positions of -log p_variant(the reference text's token)).

The reference text is the reference target's own greedy answers (bench/compare.py), so the
reference's perplexity is low by construction; the variants' are judged against it. Only the
answer's positions are scored: the prompt is context. One prompt is held at a time: its reference
log-probabilities ([answer tokens, V] float32) are computed once and compared with each variant's.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from specdecode.models.lean import LeanCache, target_cache

OVERALL = "all"


@dataclass
class TokenQuality:
    """Per scored position of one text: KL divergence (nats), whether the top-1 tokens agree,
    and the variant's negative log-likelihood of the text's token."""

    kld: torch.Tensor  # [T] float64
    agree: torch.Tensor  # [T] bool
    nll: torch.Tensor  # [T] float64


def answer_log_probs(
    model: Any, prompt_ids: Sequence[int], answer_ids: Sequence[int]
) -> torch.Tensor:
    """log-softmax of `model`'s next-token logits at the positions that predict each answer
    token, teacher-forced over prompt + answer: [len(answer), V] float32. The model runs the
    forward it decodes with as a target (`lean.target_cache`: the lean forward where it runs,
    whose quantized targets keep float32 hidden states; else its own), so what is scored is
    what generates."""
    n_answer = len(answer_ids)
    if not prompt_ids or not n_answer:
        raise ValueError("scoring needs a non-empty prompt and answer")
    # a quantized model's freed weights sit on the meta device
    device = next(p for p in model.parameters() if not p.is_meta).device
    ids = torch.tensor([[*prompt_ids, *answer_ids]], device=device)  # [1, P + T]
    cache = target_cache(model)
    with torch.inference_mode():
        if isinstance(cache, LeanCache):
            logits = cache.forward(ids[0])  # [P + T, V]
        else:
            kwargs: dict[str, Any] = {"use_cache": False}
            if "logits_to_keep" in inspect.signature(type(model).forward).parameters:
                kwargs["logits_to_keep"] = n_answer + 1  # the last T + 1 positions
            logits = model(input_ids=ids, **kwargs).logits[0]  # [T + 1 or P + T, V]
    # position P - 1 + t predicts answer token t; the last position predicts past the answer
    logits = logits[-(n_answer + 1) : -1]  # [T, V]
    return torch.log_softmax(logits.float(), dim=-1)


def token_quality(
    ref_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    answer_ids: Sequence[int],
    floor: float | None = None,
) -> TokenQuality:
    """The per-position statistics of one text: `ref_log_probs`, `log_probs` [T, V] from
    `answer_log_probs` (same width), `answer_ids` the T tokens of the text. With `floor`, the
    KL divergence sums only the tokens whose reference log-probability is above it (llama.cpp
    sums those above -16)."""
    if ref_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"log-probabilities differ in shape: {tuple(ref_log_probs.shape)} vs "
            f"{tuple(log_probs.shape)}"
        )
    p_ref = ref_log_probs.exp()  # [T, V]
    # p log(p / q) with 0 log 0 = 0 (a token the reference cannot emit adds nothing)
    keep = p_ref > 0 if floor is None else ref_log_probs > floor  # [T, V]
    terms = torch.where(keep, p_ref * (ref_log_probs - log_probs), 0.0)
    kld = terms.double().sum(-1).clamp_min(0.0)  # [T]; rounding may dip below 0
    agree = ref_log_probs.argmax(-1) == log_probs.argmax(-1)  # [T]
    target = torch.tensor(list(answer_ids), device=log_probs.device)[:, None]  # [T, 1]
    nll = -log_probs.gather(-1, target)[:, 0].double()  # [T]
    return TokenQuality(kld.cpu(), agree.cpu(), nll.cpu())


def summarize_tokens(parts: Sequence[TokenQuality]) -> dict[str, Any]:
    """Pooled statistics over every position of `parts` (llama.cpp pools over its chunks)."""
    if not parts:
        return {"tokens": 0}
    kld = torch.cat([p.kld for p in parts])
    agree = torch.cat([p.agree for p in parts])
    nll = torch.cat([p.nll for p in parts])
    if not kld.numel():
        return {"tokens": 0}
    return {
        "tokens": int(kld.numel()),
        "kld_mean": float(kld.mean()),
        "kld_median": float(torch.quantile(kld, 0.5)),
        "kld_p99": float(torch.quantile(kld, 0.99)),
        "top1_agreement": float(agree.double().mean()),
        "perplexity": math.exp(float(nll.mean())),
    }


class QualityTally:
    """Per variant and prompt category, the scored positions seen so far."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, list[TokenQuality]]] = {}

    def add(self, variant: str, category: str, part: TokenQuality) -> None:
        self.parts.setdefault(variant, {}).setdefault(category, []).append(part)

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """variant -> {"all": pooled statistics, category: its statistics, ...}."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for variant, by_category in self.parts.items():
            pooled = [part for parts in by_category.values() for part in parts]
            out[variant] = {OVERALL: summarize_tokens(pooled)}
            out[variant].update({c: summarize_tokens(p) for c, p in by_category.items()})
        return out


def score_text(
    tally: QualityTally,
    reference: Any,
    variants: Mapping[str, Any],
    category: str,
    prompt_ids: Sequence[int],
    answer_ids: Sequence[int],
) -> None:
    """Score one text (prompt + answer) for every variant (name -> model) against `reference`
    (a model; a variant that is the reference itself reuses its log-probabilities)."""
    if not answer_ids:
        return  # nothing was generated: no position to score
    ref = answer_log_probs(reference, prompt_ids, answer_ids)
    for name, model in variants.items():
        log_probs = ref if model is reference else answer_log_probs(model, prompt_ids, answer_ids)
        tally.add(name, category, token_quality(ref, log_probs, answer_ids))


def measure_quality(
    reference: Any,
    variants: Mapping[str, Any],
    texts: Sequence[tuple[str, Sequence[int], Sequence[int]]],
    progress: bool = True,
) -> dict[str, dict[str, dict[str, Any]]]:
    """`QualityTally.summary` over `texts` ((category, prompt ids, answer ids) each)."""
    tally = QualityTally()
    for category, prompt_ids, answer_ids in tqdm(
        texts, desc="quality", unit="text", disable=not progress
    ):
        score_text(tally, reference, variants, category, prompt_ids, answer_ids)
    return tally.summary()
