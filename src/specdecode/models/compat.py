"""Can this draft serve this target? Tokenizer and vocabulary checks."""

from __future__ import annotations

from typing import Any


def logits_size(model: Any) -> int:
    """Rows of the output embedding: the width of the logits (often padded past the tokenizer)."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


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


def common_vocab_size(target: Any, draft: Any) -> int:
    """Vocabulary both models can score: min of the two logit widths.

    Embedding matrices padded to different sizes (151936 vs 152064) are fine as long as every real
    token fits in both; genuinely different tokenizers raise ValueError saying what differs.
    `target` and `draft` are LoadedModel-like (attributes `model` and `tokenizer`).
    """
    if target.tokenizer is not None and draft.tokenizer is not None:
        difference = describe_vocab_difference(target.tokenizer, draft.tokenizer)
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
