"""One record per prompt x setting x repeat: what was generated, how fast, and how well drafted.

A `Record` is one JSON line of results.jsonl (`to_dict` / `from_dict`, the keys in the order of
its fields), so a saved run can be re-aggregated and re-rendered without the models
(`specdecode report DIR`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from specdecode.core import metrics
from specdecode.models.lean import target_cache

if TYPE_CHECKING:
    from specdecode.bench.methods import RunOutput, Setting
    from specdecode.core.types import Stats
    from specdecode.data.suites import BenchPrompt


@dataclass
class Record:
    """What one prompt x setting x repeat (at one turn) generated and measured (times in s).

    Every field has a default, so a saved record from before a field existed still loads.
    """

    prompt_id: str = ""
    category: str = ""
    turn: int = 0
    repeat: int = 0
    method: str = ""
    setting: str = ""  # the setting's label: its column in the tables
    draft: str | None = None
    k: int = 0
    k_policy: str = "fixed"
    tree: str | None = None
    dtype: str = ""
    temperature: float = 0.0
    prompt_tokens: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    prefill_s: float | None = None
    # the run started from a prompt cache prefilled once (this long) and shared by several
    # methods: its `ttft_s` and `tokens_per_s` leave the target prefill out
    shared_prefill_s: float | None = None
    ttft_s: float = 0.0
    decode_s: float = 0.0
    first_chunk: int = 0  # tokens available at ttft
    tokens_per_s: float | None = None
    # decode rate: tokens after the first block over the time after it (prefill excluded)
    decode_tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_source: str = ""
    identical_to_ar: bool | None = None  # greedy runs only (mark_identity)
    first_divergence: dict[str, Any] | None = None
    token_ids: list[int] = field(default_factory=list)
    # the core's counters (Stats): None for Hugging Face's methods
    steps: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    emitted: int | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    drafted_at: list[int] | None = None
    accepted_at: list[int] | None = None
    per_position_acceptance: list[float | None] | None = None
    target_forwards: int | None = None
    target_forward_s: float | None = None
    draft_forwards: int | None = None
    draft_forward_s: float | None = None
    # Stats' other fields (those later drafters and policies add ride along), by their names
    extra: dict[str, Any] = field(default_factory=dict)
    # a tuned config (`bench --config`): `setting` is its column, `ran` what this prompt ran
    tuned: bool = False
    ran: str | None = None
    # the target every method ran, as named (`MODEL:int4` for a 4-bit one): `ar` and the identity
    # checks' reference; None in records from before it was written
    target: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON line's keys: the fields in order (`target` after `setting`, where known),
        then `extra`'s, then `tuned` and `ran` for a tuned config's record only."""
        out: dict[str, Any] = {}
        for name in _FIELDS:
            out[name] = getattr(self, name)
            if name == "setting" and self.target is not None:
                out["target"] = self.target
        out.update(self.extra)
        if self.tuned:
            out.update(tuned=True, ran=self.ran)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Record:
        """The inverse of `to_dict`; keys it does not know go to `extra` (in their order)."""
        known = {name: data[name] for name in (*_FIELDS, *_OPTIONAL) if name in data}
        extra = {key: value for key, value in data.items() if key not in known}
        return cls(**known, extra=extra)


# the fields written only where set: a tuned config's `tuned` and `ran`, the target's name
_OPTIONAL = ("tuned", "ran", "target")
# the fields written as they are (not `extra`, nor the optional ones)
_FIELDS = tuple(f.name for f in fields(Record) if f.name not in ("extra", *_OPTIONAL))


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
    target: str | None = None,
) -> Record:
    """The record of one run of `setting` on `prompt_ids` (`Record.shared_prefill_s` says what
    `shared_prefill_s` means; `target` names the model it ran, suffix included)."""
    n = len(out.token_ids)
    decode_s = out.wall_time_s - out.ttft_s
    record = Record(
        prompt_id=prompt.id,
        category=prompt.category,
        turn=turn,
        repeat=repeat,
        method=setting.method,
        setting=setting.label,
        draft=setting.draft,
        k=setting.k,
        k_policy=setting.policy,
        tree=setting.tree,
        dtype=dtype,
        temperature=temperature,
        prompt_tokens=len(prompt_ids),
        new_tokens=n,
        wall_time_s=out.wall_time_s,
        prefill_s=out.prefill_s,
        shared_prefill_s=shared_prefill_s,
        ttft_s=out.ttft_s,
        decode_s=decode_s,
        first_chunk=out.first_chunk,
        tokens_per_s=metrics.ratio(n, out.wall_time_s),
        decode_tokens_per_s=metrics.ratio(n - out.first_chunk, decode_s)
        if n > out.first_chunk
        else None,
        peak_memory_bytes=memory_bytes,
        memory_source=memory_source,
        token_ids=out.token_ids,
        target=target,
    )
    if out.stats is not None:
        _add_stats(record, out.stats)
    return record


def _add_stats(record: Record, stats: Stats) -> None:
    """Copy the core's counters (a `Stats`) onto `record`."""
    record.steps = stats.steps
    record.drafted = stats.drafted
    record.accepted = stats.accepted
    record.emitted = stats.emitted
    record.acceptance_rate = stats.acceptance_rate
    record.mean_acceptance_length = stats.mean_acceptance_length
    record.drafted_at = stats.drafted_at
    record.accepted_at = stats.accepted_at
    record.per_position_acceptance = stats.per_position_acceptance
    record.target_forwards = stats.meter.calls.get("target", 0)
    record.target_forward_s = stats.meter.seconds.get("target", 0.0)
    record.draft_forwards = stats.meter.calls.get("draft", 0)
    record.draft_forward_s = stats.meter.seconds.get("draft", 0.0)
    # fields later drafters and policies add to Stats ride along (its per-kind times are above)
    record.extra = {
        key: value
        for key, value in stats.to_dict().items()
        if key not in _FIELDS and key not in _NOT_CARRIED
    }


# Stats fields a record does not carry: the per-kind times are above, and k_max is the setting's
# `k` (the record's own field) under its Stats name
_NOT_CARRIED = ("forward_s", "k_max")


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """The first position where `other` differs from `reference`, or None if identical."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


@torch.inference_mode()
def top2_margin(target: Any, prompt_ids: list[int], ar_ids: list[int], position: int) -> float:
    """The target's top-1 minus top-2 logit where the outputs diverge, computed the plain way
    (one forward over prompt + the AR tokens before `position`, through the forward the target
    decodes with: `lean.target_cache`)."""
    cache = target_cache(target)
    device = next(target.parameters()).device
    context = torch.tensor([*prompt_ids, *ar_ids[:position]], device=device)
    logits = cache.forward(context, last_only=True)[0].float()  # [V]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def mark_identity(
    ar_record: Record, record: Record, margin: Callable[[int], float] | None = None
) -> None:
    """Fill `identical_to_ar` and `first_divergence` of a greedy record against the AR record.

    `margin(position) -> float` gives the target's top-2 margin there (None: not computed).
    """
    ar_ids, ids = ar_record.token_ids, record.token_ids
    position = first_divergence(ar_ids, ids)
    record.identical_to_ar = position is None
    record.first_divergence = None
    if position is None:
        return
    record.first_divergence = {
        "position": position,
        "ar_token": ar_ids[position] if position < len(ar_ids) else None,
        "spec_token": ids[position] if position < len(ids) else None,
        "top2_margin": margin(position) if margin is not None and position < len(ar_ids) else None,
    }
