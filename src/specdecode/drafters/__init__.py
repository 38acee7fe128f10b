"""Drafters: whatever proposes tokens (a second model, the target's first layers, ...)."""

from __future__ import annotations

from typing import Any

from specdecode.drafters.base import Drafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.model import ModelDrafter

__all__ = ["Drafter", "EarlyExitDrafter", "ModelDrafter", "resolve_draft"]

DRAFT_FORMS = "a model (preset, folder, .gguf, hub id) or early-exit:N"


def resolve_draft(spec: str | None, target: Any, dtype: Any = "bfloat16", device: Any = None):
    """Turn a `--draft` value into what `SpeculativeDecoder(draft=...)` takes.

    `None` -> None (autoregressive); `early-exit:N` -> an EarlyExitDrafter over `target` (a
    LoadedModel); anything else is loaded with `load_model`.
    """
    if spec is None:
        return None
    if spec.startswith("early-exit"):
        _, _, depth = spec.partition(":")
        if not depth.isdigit():
            raise ValueError(f"early-exit draft needs a depth, e.g. early-exit:8 (got {spec!r})")
        return EarlyExitDrafter(target.model, int(depth))
    from specdecode.models.loading import load_model

    return load_model(spec, dtype=dtype, device=device)
