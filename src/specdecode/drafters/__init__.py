"""Drafters: whatever proposes tokens (a second model, the target's first layers, ...)."""

from __future__ import annotations

from typing import Any

from specdecode.core.draft_spec import DraftSpec
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
    spec: str | DraftSpec | None,
    target: Any,
    dtype: Any = "bfloat16",
    device: Any = None,
    draft_vocab: int | str | None = None,
):
    """Turn a `--draft` value (its text or its DraftSpec) into what `SpeculativeDecoder(draft=...)`
    takes; ValueError for a bad spec (draft_spec.py), before anything is loaded.

    `None` -> None (autoregressive); `early-exit:N` -> an EarlyExitDrafter over `target` (a
    LoadedModel); `ngram` or `ngram:MIN-MAX` -> prompt lookup (default 1-3); a model is loaded
    with `load_model`, and `MODEL:int8` / `MODEL:int4` then runs its linears on int8 / 4-bit
    weights (bfloat16 on a CPU with AVX2 only; models/quantized.py), its bfloat16 weights freed.
    `distilled:DIR[:int8|:int4]` loads the base draft DIR/distill.json names with DIR's adapter
    merged (then quantized, where asked), checked against `target`'s tokenizer.
    `eagle:DIR[:int8|:int4]` -> an EagleDrafter: DIR's head over `target`'s features
    (models/eagle_head.py), on the kernels and the weights asked for, like a draft model's.

    A draft model's output layer keeps `draft_vocab` ids (None: $SPECDECODE_DRAFT_VOCAB, else
    draft_spec.DEFAULT_DRAFT_VOCAB; 0 or "all": every id), checked before anything is loaded.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = DraftSpec.parse(spec)
    if spec.kind == "ngram":
        return NgramDrafter(*spec.ngram)
    if spec.kind == "early-exit":
        return EarlyExitDrafter(target.model, spec.depth)
    from specdecode.core.draft_spec import resolve_draft_vocab
    from specdecode.models.loading import load_model

    vocab = resolve_draft_vocab(draft_vocab)
    if spec.kind == "distilled":
        return _load_distilled(spec, target, dtype, device, vocab)
    if spec.kind == "eagle":
        return _load_eagle(spec, target, vocab)
    return load_model(spec.model, dtype=dtype, device=device, role="draft", draft_vocab=vocab)


def _load_distilled(spec: DraftSpec, target: Any, dtype: Any, device: Any, vocab: int | None):
    from specdecode.core.draft_spec import ModelSpec
    from specdecode.models.adapters import check_target, read_result
    from specdecode.models.loading import load_model

    folder = spec.distilled_dir
    record = read_result(folder)  # a half-written or missing result fails before loading
    check_target(record, folder, target)
    base = ModelSpec(record["draft"], spec.model.quantization)  # type: ignore[union-attr]
    loaded = load_model(
        base,
        dtype=dtype,
        device=device,
        role="draft",
        adapter=folder,
        draft_vocab=vocab,
    )
    loaded.name = str(spec)
    loaded.extra["distilled"] = {"folder": folder, "base": record["draft"]}
    return loaded


def _load_eagle(spec: DraftSpec, target: Any, vocab: int | None):
    from specdecode.drafters.eagle import EagleDrafter
    from specdecode.kernels.cpu_linear import apply_kernel
    from specdecode.models.adapters import check_target
    from specdecode.models.compat import logits_size
    from specdecode.models.eagle_head import load_head
    from specdecode.models.loading import wrap_model
    from specdecode.models.quantized import quantize_loaded

    folder = spec.eagle_dir
    model = getattr(target, "model", target)
    head, record = load_head(folder, model, vocab, getattr(target, "tokenizer", None))
    check_target(record, folder, target, "EAGLE head")
    loaded = wrap_model(head, name=str(spec))
    loaded.kernel = apply_kernel(head)
    quantize_loaded(loaded, spec.model, keep_weights=False, role="draft")  # type: ignore[arg-type]
    return EagleDrafter(head, model, vocab_size=logits_size(model), name=str(spec))
