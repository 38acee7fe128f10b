"""What a model's config says that the engine needs: can this draft serve this target
(tokenizer and vocabulary checks), the context length, the sampling defaults its authors set."""

from __future__ import annotations

from typing import Any

from specdecode.core.request import SamplingDefaults


def logits_size(model: Any) -> int:
    """Rows of the output embedding: the width of the logits (often padded past the tokenizer;
    a draft vocabulary's output layer gives the full width too, models/draft_vocab.py)."""
    head = model.get_output_embeddings()
    if head is None:
        return int(model.config.vocab_size)
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def describe_vocab_difference(target_tok: Any, draft_tok: Any) -> str | None:
    """None when both tokenizers map the same strings to the same ids, else what differs."""
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab == d_vocab:
        return None
    if len(t_vocab) != len(d_vocab):
        return f"the target's tokenizer has {len(t_vocab)} tokens, the draft's {len(d_vocab)}"
    for token, t_id in sorted(t_vocab.items(), key=lambda item: item[1]):
        d_id = d_vocab.get(token)
        if d_id != t_id:
            where = f"id {d_id}" if d_id is not None else "absent"
            return (
                f"token {token!r} is id {t_id} in the target's tokenizer but {where} in the draft's"
            )
    return "the tokenizers map tokens to different ids"


def tokenizer_difference(target: Any, draft: Any) -> str | None:
    """What differs between the tokenizers of `target` and `draft` (LoadedModel-like), or None
    when they are the same or one of them has none (nothing to compare)."""
    if target.tokenizer is None or draft.tokenizer is None:
        return None
    return describe_vocab_difference(target.tokenizer, draft.tokenizer)


def common_vocab_size(target: Any, draft: Any) -> int:
    """Vocabulary both models can score: min of the two logit widths.

    Embedding matrices padded to different sizes (151936 vs 152064) are fine as long as every real
    token fits in both; genuinely different tokenizers raise ValueError saying what differs.
    `target` and `draft` are LoadedModel-like (attributes `model` and `tokenizer`).
    """
    difference = tokenizer_difference(target, draft)
    if difference is not None:
        raise ValueError(f"incompatible tokenizers: {difference}")
    common = min(logits_size(target.model), logits_size(draft.model))
    tokenizer = target.tokenizer or draft.tokenizer
    if tokenizer is not None and len(tokenizer) > common:
        raise ValueError(
            f"incompatible vocabularies: the tokenizer has {len(tokenizer)} tokens but one model "
            f"scores only {common}"
        )
    return common


def context_length(model: Any) -> int | None:
    """The model's maximum positions, when its config says."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def generation_defaults(model: Any) -> SamplingDefaults:
    """The temperature, top-k and top-p the model's authors set in its generation config
    (generation_config.json), as vLLM reads them: only values that differ from transformers'
    `GenerationConfig()` defaults count (in transformers 5 those are all None: unset).

    A generation config means what transformers' `generate` does with it: sampling only with
    `do_sample=True` (then at its temperature, else 1.0). A config that sets sampling values
    without `do_sample=True` decodes greedily there, so its default here is greedy too.
    """
    # slow import (transformers, ~1 s): models/ is imported by the command line's parser
    from transformers import GenerationConfig

    config = getattr(model, "generation_config", None)
    if config is None:
        return SamplingDefaults()
    unset = GenerationConfig()

    def authored(name: str) -> Any:
        value = getattr(config, name, None)
        return None if value is None or value == getattr(unset, name, None) else value

    do_sample, temperature = authored("do_sample"), authored("temperature")
    top_k, top_p = authored("top_k"), authored("top_p")
    top_k = int(top_k) if top_k else None  # 0: no top-k
    top_p = float(top_p) if top_p is not None and top_p < 1.0 else None
    if do_sample is True:
        temperature = 1.0 if temperature is None else float(temperature)
        return SamplingDefaults(temperature=temperature, top_k=top_k, top_p=top_p)
    if do_sample is None and temperature is None and top_k is None and top_p is None:
        return SamplingDefaults()  # the model says nothing
    return SamplingDefaults(temperature=0.0)  # greedy, as transformers' generate would be
