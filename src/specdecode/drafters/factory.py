"""The one drafter factory: a `--draft` spec loaded into what it names (`resolve_draft`), and
whatever `SpeculativeDecoder(draft=..., tree=..., confidence=...)` was given turned into the
drafter that runs (`make_drafter`): a model into a chain or tree drafter, a drafter as it is."""

from __future__ import annotations

from typing import Any

from specdecode.core.draft_spec import DraftSpec, ModelSpec, resolve_draft_vocab
from specdecode.core.policies import prior_cost_ratio
from specdecode.core.protocols import Drafter
from specdecode.core.tree import TreeDrafter, check_tree_attention
from specdecode.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdecode.drafters.eagle import EagleDrafter, TreeEagleDrafter
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.model import ModelDrafter, check_confidence
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.drafters.tree_model import TreeModelDrafter
from specdecode.drafters.tree_shape import parse_tree_spec
from specdecode.kernels.cpu_linear import apply_kernel
from specdecode.models.adapters import check_target, read_result
from specdecode.models.compat import common_vocab_size, logits_size, tokenizer_difference
from specdecode.models.eagle_head import load_head
from specdecode.models.loading import load_model, wrap_model
from specdecode.models.quantized import quantize_loaded
from specdecode.models.tokenizer_bridge import round_trip_failure, shared_tokens


def make_drafter(
    draft: Any,
    target: Any,
    *,
    tree: str | None = None,
    confidence: float | None = None,
) -> Drafter | TreeDrafter | None:
    """The drafter that runs for `draft`: None (autoregressive) stays None; a `Drafter` or
    `TreeDrafter` runs as it is; a model (a LoadedModel or a transformers model) drafts a chain
    over the vocabulary it shares with `target` (a LoadedModel). `tree` ("static:3,2,2" or
    "dynamic:16", drafters/tree_shape.py) makes a model draft (or a ModelDrafter such as
    early-exit:N) grow a token tree instead; `confidence` stops a model draft's chain before a
    token whose top draft probability is below it. ValueError where the draft cannot do that."""
    if tree is not None:
        shape = parse_tree_spec(tree)
        check_tree_attention(target.model, "target")
        if isinstance(draft, ModelDrafter):
            return TreeModelDrafter(draft.model, shape, draft.vocab_size, draft.name)
        if isinstance(draft, EagleDrafter):
            return TreeEagleDrafter(draft.head, target.model, shape, draft.vocab_size, draft.name)
        if isinstance(draft, (SuffixDrafter, HybridDrafter)):
            raise ValueError(f"tree={tree!r}: {draft.name} drafts trees of its own shape")
        if draft is None or isinstance(draft, (Drafter, TreeDrafter)):
            raise ValueError(
                f"tree={tree!r} needs a draft model (a model, early-exit:N or an EAGLE-3 head)"
            )
        loaded = wrap_model(draft)
        _same_tokenizer(target, loaded, f"tree={tree!r}")
        return TreeModelDrafter(loaded.model, shape, common_vocab_size(target, loaded), loaded.name)
    if draft is None or isinstance(draft, (Drafter, TreeDrafter)):
        drafter = draft
    else:
        drafter = model_drafter(wrap_model(draft), target)
    if confidence is not None:
        if isinstance(drafter, CrossTokenizerDrafter):
            raise ValueError("confidence needs a draft of the target's tokenizer")
        if not isinstance(drafter, ModelDrafter):
            raise ValueError("confidence needs a model draft (a model or early-exit:N)")
        drafter.confidence = check_confidence(confidence)
    return drafter


def model_drafter(loaded: Any, target: Any) -> ModelDrafter | CrossTokenizerDrafter:
    """A chain drafter over the draft model `loaded` for `target` (LoadedModels): a
    ModelDrafter over their common vocabulary, or, where the tokenizers differ, a
    CrossTokenizerDrafter; ValueError for a draft of another tokenizer that cannot write the
    target's text or shares no token with it."""
    difference = tokenizer_difference(target, loaded)
    if difference is None:
        vocab = common_vocab_size(target, loaded)
        return ModelDrafter(loaded.model, vocab_size=vocab, name=loaded.name)
    failure = round_trip_failure(target.tokenizer, loaded.tokenizer)
    if failure is not None:
        raise ValueError(
            f"draft {loaded.name} has another tokenizer ({difference}) and cannot write the "
            f"target's text: {failure}"
        )
    width = logits_size(target.model)
    shared = shared_tokens(target.tokenizer, loaded.tokenizer, logits_size(loaded.model), width)
    if not len(shared):
        raise ValueError(
            f"draft {loaded.name} has another tokenizer ({difference}) and no token in common "
            "with the target's"
        )
    return CrossTokenizerDrafter(
        loaded.model, target.tokenizer, loaded.tokenizer, shared, width, name=loaded.name
    )


def _same_tokenizer(target: Any, loaded: Any, what: str) -> None:
    """ValueError naming `what` where the draft's tokenizer is not the target's."""
    difference = tokenizer_difference(target, loaded)
    if difference is not None:
        raise ValueError(
            f"{what} needs a draft of the target's tokenizer ({difference}); a draft of "
            "another tokenizer drafts chains"
        )


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
    LoadedModel); `ngram` or `ngram:MIN-MAX` -> prompt lookup (default 1-3); `suffix[:OPTIONS]`
    -> a SuffixDrafter; `MODEL+suffix[:OPTIONS]` -> a HybridDrafter of MODEL (loaded as below)
    and a SuffixDrafter; a model is loaded
    with `load_model`, and `MODEL:int8` / `MODEL:int4` then runs its linears on int8 / 4-bit
    weights (bfloat16 on a CPU with AVX2 only; models/quantized.py), its bfloat16 weights freed.
    `distilled:DIR[:int8|:int4]` loads the base draft DIR/distill.json names with DIR's adapter
    merged (then quantized, where asked), checked against `target`'s tokenizer.
    `eagle3:DIR[:int8|:int4]` (or `eagle:DIR`) -> an EagleDrafter: DIR's EAGLE-3 head, as
    published or trained by `distill --kind eagle`, over `target`'s features
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
    if spec.kind == "suffix":
        return SuffixDrafter(spec.suffix)
    if spec.kind == "early-exit":
        return EarlyExitDrafter(target.model, spec.depth)
    vocab = resolve_draft_vocab(draft_vocab)
    if spec.kind == "distilled":
        return _load_distilled(spec, target, dtype, device, vocab)
    if spec.kind == "eagle":
        return _load_eagle(spec, target)
    loaded = load_model(spec.model, dtype=dtype, device=device, role="draft", draft_vocab=vocab)
    if spec.kind == "hybrid":
        return hybrid_drafter(loaded, target, spec.suffix)
    return loaded


def hybrid_drafter(draft: Any, target: Any, options: Any = None) -> HybridDrafter:
    """`MODEL+suffix`: `draft` (a model, loaded or not) drafting chains over the vocabulary it
    shares with `target` (a LoadedModel), in turns with a SuffixDrafter of `options`."""
    loaded = wrap_model(draft)
    _same_tokenizer(target, loaded, f"{loaded.name}+suffix")
    model = ModelDrafter(loaded.model, common_vocab_size(target, loaded), loaded.name)
    prior = prior_cost_ratio(target.model, model)
    suffix = SuffixDrafter(options)
    return HybridDrafter(model, suffix, prior_cost=prior if prior is not None else 0.25)


def _load_distilled(spec: DraftSpec, target: Any, dtype: Any, device: Any, vocab: int | None):
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


def _load_eagle(spec: DraftSpec, target: Any):
    folder = spec.eagle_dir
    model = getattr(target, "model", target)
    head, record = load_head(folder, model)
    if record is not None:  # a head trained here: its tokenizer and target checked too
        check_target(record, folder, target, "EAGLE-3 head")
    loaded = wrap_model(head, name=str(spec))
    loaded.kernel = apply_kernel(head)
    quantize_loaded(loaded, spec.model, keep_weights=False, role="draft")  # type: ignore[arg-type]
    return EagleDrafter(head, model, vocab_size=logits_size(model), name=str(spec))
