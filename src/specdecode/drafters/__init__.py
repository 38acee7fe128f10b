"""Drafters: whatever proposes tokens (a second model, the target's first layers, ...)."""

from __future__ import annotations

from typing import Any

import torch

from specdecode.drafters.base import Drafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.ngram import NgramDrafter

INT8_SUFFIX = ":int8"  # MODEL:int8 drafts with int8 weights (specdecode.kernels.quantize_linears)
INT4_SUFFIX = ":int4"  # MODEL:int4 with 4-bit weights (groups of 32; the tied output layer int8)
QUANT_BITS = {INT8_SUFFIX: 8, INT4_SUFFIX: 4}


def split_quantization(spec: str) -> tuple[str, str]:
    """ "MODEL:int8" -> ("MODEL", ":int8"); "MODEL:int4" likewise; anything else -> (spec, "")."""
    for suffix in QUANT_BITS:
        if spec.endswith(suffix):
            return spec[: -len(suffix)], suffix
    return spec, ""


__all__ = [
    "INT4_SUFFIX",
    "INT8_SUFFIX",
    "Drafter",
    "EarlyExitDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "resolve_draft",
]


def resolve_draft(spec: str | None, target: Any, dtype: Any = "bfloat16", device: Any = None):
    """Turn a `--draft` value into what `SpeculativeDecoder(draft=...)` takes.

    `None` -> None (autoregressive); `early-exit:N` -> an EarlyExitDrafter over `target` (a
    LoadedModel); `ngram` or `ngram:MIN-MAX` -> prompt lookup (default 1-3); anything else is
    loaded with `load_model`, and `MODEL:int8` / `MODEL:int4` then runs its linears on int8 /
    4-bit weights (bfloat16 on a CPU with AVX2 only; `specdecode.kernels.quantize_linears`).
    """
    if spec is None:
        return None
    base, suffix = split_quantization(spec)
    if suffix and (base.startswith(("ngram", "early-exit")) or not base):
        raise ValueError(
            f"{suffix} quantizes a draft model (e.g. qwen2.5-coder-0.5b-instruct{suffix}); "
            f"n-gram drafts have no weights and early-exit shares the target's (got {spec!r})"
        )
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

    if not suffix:
        return load_model(spec, dtype=dtype, device=device)
    return quantized_draft(load_model(base, dtype=dtype, device=device), spec)


def quantized_draft(draft: Any, spec: str) -> Any:
    """`draft` (a LoadedModel) with its linears on the weights `spec`'s suffix asks for
    (`MODEL:int8` or `MODEL:int4`); ValueError where that cannot run."""
    from specdecode.kernels.cpu_linear import QUANT_NAMES, KernelUnavailable, quantize_linears

    suffix = split_quantization(spec)[1]
    bits, kind = QUANT_BITS[suffix], suffix.lstrip(":")
    if draft.dtype != torch.bfloat16 or draft.device.type != "cpu":
        raise ValueError(
            f"{spec}: {kind} drafts run on the CPU kernel with bfloat16 activations; "
            f"use --dtype bfloat16 on the CPU (the draft is {draft.dtype} on {draft.device})"
        )
    try:
        quantize_linears(draft.model, bits=bits)
    except KernelUnavailable as err:
        raise ValueError(f"{spec}: the {kind} CPU kernel cannot be used: {err}") from err
    draft.kernel, draft.name = QUANT_NAMES[bits], f"{draft.name}{suffix}"
    return draft
