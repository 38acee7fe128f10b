"""One record per prompt x setting x repeat: what was generated, how fast, and how well drafted.

Records are plain dicts (one JSON line each in results.jsonl) so a saved run can be re-aggregated
and re-rendered without the models (`specdecode report DIR`).
"""

from __future__ import annotations

from typing import Any

import torch

from specdecode import metrics
from specdecode.bench.methods import RunOutput, Setting
from specdecode.bench.suites import BenchPrompt
from specdecode.cache import KVCache


def make_record(
    prompt: BenchPrompt,
    turn: int,
    repeat: int,
    setting: Setting,
    prompt_ids: list[int],
    out: RunOutput,
    *,
    dtype: str,
    temperature: float,
    memory_bytes: int,
    memory_source: str,
    shared_prefill_s: float | None = None,
) -> dict[str, Any]:
    """`shared_prefill_s`: the run started from a prompt cache prefilled once (that long) and
    shared by several methods, so its `ttft_s` and `tokens_per_s` leave the target prefill out."""
    n = len(out.token_ids)
    decode_s = out.wall_time_s - out.ttft_s
    record: dict[str, Any] = {
        "prompt_id": prompt.id,
        "category": prompt.category,
        "turn": turn,
        "repeat": repeat,
        "method": setting.method,
        "setting": setting.label,
        "draft": setting.draft,
        "k": setting.k,
        "k_policy": setting.policy,
        "tree": setting.tree,
        "dtype": dtype,
        "temperature": temperature,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n,
        "wall_time_s": out.wall_time_s,
        "prefill_s": out.prefill_s,
        "shared_prefill_s": shared_prefill_s,
        "ttft_s": out.ttft_s,
        "decode_s": decode_s,
        "first_chunk": out.first_chunk,
        "tokens_per_s": metrics.ratio(n, out.wall_time_s),
        # decode rate: tokens after the first block over the time after it (prefill excluded)
        "decode_tokens_per_s": metrics.ratio(n - out.first_chunk, decode_s)
        if n > out.first_chunk
        else None,
        "peak_memory_bytes": memory_bytes,
        "memory_source": memory_source,
        "identical_to_ar": None,
        "first_divergence": None,
        "token_ids": out.token_ids,
    }
    stats = out.stats
    record.update(
        steps=stats.steps if stats else None,
        drafted=stats.drafted if stats else None,
        accepted=stats.accepted if stats else None,
        emitted=stats.emitted if stats else None,
        acceptance_rate=stats.acceptance_rate if stats else None,
        mean_acceptance_length=stats.mean_acceptance_length if stats else None,
        drafted_at=stats.drafted_at if stats else None,
        accepted_at=stats.accepted_at if stats else None,
        per_position_acceptance=stats.per_position_acceptance if stats else None,
        target_forwards=stats.meter.calls.get("target", 0) if stats else None,
        target_forward_s=stats.meter.seconds.get("target", 0.0) if stats else None,
        draft_forwards=stats.meter.calls.get("draft", 0) if stats else None,
        draft_forward_s=stats.meter.seconds.get("draft", 0.0) if stats else None,
    )
    if stats is not None:  # fields later drafters and policies add to Stats ride along
        extra = {k: v for k, v in stats.to_dict().items() if k not in record and k != "forward_s"}
        record.update(extra)
    return record


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """The first position where `other` differs from `reference`, or None if identical."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@torch.inference_mode()
def top2_margin(target: Any, prompt_ids: list[int], ar_ids: list[int], position: int) -> float:
    """The target's top-1 minus top-2 logit where the outputs diverge, computed the plain way
    (one forward over prompt + the AR tokens before `position`)."""
    cache = KVCache(target)
    device = next(target.parameters()).device
    context = torch.tensor([*prompt_ids, *ar_ids[:position]], device=device)
    logits = cache.forward(context, last_only=True)[0].float()  # [V]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def mark_identity(
    ar_record: dict[str, Any], record: dict[str, Any], margin: Any | None = None
) -> None:
    """Fill `identical_to_ar` and `first_divergence` of a greedy record against the AR record.

    `margin(position) -> float` gives the target's top-2 margin there (None: not computed).
    """
    ar_ids, ids = ar_record["token_ids"], record["token_ids"]
    position = first_divergence(ar_ids, ids)
    record["identical_to_ar"] = position is None
    record["first_divergence"] = None
    if position is None:
        return
    record["first_divergence"] = {
        "position": position,
        "ar_token": ar_ids[position] if position < len(ar_ids) else None,
        "spec_token": ids[position] if position < len(ids) else None,
        "top2_margin": margin(position) if margin is not None and position < len(ar_ids) else None,
    }
