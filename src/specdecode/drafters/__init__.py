"""Drafters: whatever proposes tokens (a second model, the target's first layers, ...)."""

from __future__ import annotations

from typing import Any

from specdecode.drafters.base import Drafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "EarlyExitDrafter", "ModelDrafter", "NgramDrafter", "resolve_draft"]


def resolve_draft(spec: str | None, target: Any, dtype: Any = "bfloat16", device: Any = None):
    """Turn a `--draft` value into what `SpeculativeDecoder(draft=...)` takes.

    `None` -> None (autoregressive); `early-exit:N` -> an EarlyExitDrafter over `target` (a
    LoadedModel); `ngram` or `ngram:MIN-MAX` -> prompt lookup (default 1-3); anything else is
    loaded with `load_model`.
    """
    if spec is None:
        return None
    if spec == "ngram" or spec.startswith("ngram:"):
        sizes = spec.partition(":")[2] if ":" in spec else "1-3"
        low, _, high = sizes.partition("-")
        if not (low.isdigit() and high.isdigit()):
            raise ValueError(
                f"n-gram draft is ngram or ngram:MIN-MAX, e.g. ngram:1-3 (got {spec!r})"
            )
        return NgramDrafter(int(low), int(high))
    if spec.startswith("early-exit"):
        _, _, depth = spec.partition(":")
        if not depth.isdigit():
            raise ValueError(f"early-exit draft needs a depth, e.g. early-exit:8 (got {spec!r})")
        return EarlyExitDrafter(target.model, int(depth))
    from specdecode.models.loading import load_model

    return load_model(spec, dtype=dtype, device=device)
