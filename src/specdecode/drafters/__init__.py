"""Drafters: whatever proposes tokens (a second model, the target's first layers, ...)."""

from __future__ import annotations

from typing import Any

import torch

from specdecode.draft_spec import DraftSpec, ModelSpec
from specdecode.drafters.base import Drafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.ngram import NgramDrafter

__all__ = [
    "DraftSpec",
    "Drafter",
    "EarlyExitDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "resolve_draft",
]


def resolve_draft(
    spec: str | DraftSpec | None, target: Any, dtype: Any = "bfloat16", device: Any = None
):
    """Turn a `--draft` value (its text or its DraftSpec) into what `SpeculativeDecoder(draft=...)`
    takes; ValueError for a bad spec (draft_spec.py), before anything is loaded.

    `None` -> None (autoregressive); `early-exit:N` -> an EarlyExitDrafter over `target` (a
    LoadedModel); `ngram` or `ngram:MIN-MAX` -> prompt lookup (default 1-3); a model is loaded
    with `load_model`, and `MODEL:int8` / `MODEL:int4` then runs its linears on int8 / 4-bit
    weights (bfloat16 on a CPU with AVX2 only; `specdecode.kernels.quantize_linears`).
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = DraftSpec.parse(spec)
    if spec.kind == "ngram":
        return NgramDrafter(*spec.ngram)
    if spec.kind == "early-exit":
        return EarlyExitDrafter(target.model, spec.depth)
    from specdecode.models.loading import load_model

    model = spec.model
    draft = load_model(model.name, dtype=dtype, device=device)
    return quantized_draft(draft, model) if model.quantization else draft


def quantized_draft(draft: Any, model: ModelSpec) -> Any:
    """`draft` (a LoadedModel) with its linears on the weights `model.quantization` asks for
    (int8 or int4); ValueError where that cannot run."""
    from specdecode.kernels.build import KernelUnavailable
    from specdecode.kernels.quantize import quant_name, quantize_linears

    kind = model.quantization
    if draft.dtype != torch.bfloat16 or draft.device.type != "cpu":
        raise ValueError(
            f"{model}: {kind} drafts run on the CPU kernel with bfloat16 activations; "
            f"use --dtype bfloat16 on the CPU (the draft is {draft.dtype} on {draft.device})"
        )
    try:
        quantize_linears(draft.model, bits=model.bits)
    except KernelUnavailable as err:
        raise ValueError(f"{model}: the {kind} CPU kernel cannot be used: {err}") from err
    draft.kernel, draft.name = quant_name(model.bits), f"{draft.name}:{kind}"
    return draft
