"""A draft's output layer over part of the vocabulary: the draft vocabulary.

A draft's output layer multiplies its last hidden state by one row per token of the vocabulary:
on a 0.5B draft with 151,936 tokens that is over a quarter of the weights a draft forward reads.
Most of those rows are tokens the target almost never says. The draft vocabulary keeps the first
N ids and every special or added token (end of turn, end of text: the draft must be able to
propose stopping) and computes only their logits; the others get -inf, so the draft never
proposes them and its distribution q is exactly the one it samples from. Verification is
unchanged: output stays lossless, greedy and sampled; a token outside the draft vocabulary is
simply never drafted (the target's own token is kept at that position, as for any rejection).

Why the first N ids: a byte-pair tokenizer numbers its tokens in the order it learnt their merges,
most frequent first, so a prefix of the ids is a frequency ranking that needs no data (the idea of
keeping only frequent tokens in the draft's head: FR-Spec, Zhao et al. 2025). How much of the
target's output falls inside, and what it saves, is measured in docs/results.md. The size: draft_spec.DEFAULT_DRAFT_VOCAB, --draft-vocab,
$SPECDECODE_DRAFT_VOCAB.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch


class DraftVocabHead(torch.nn.Module):
    """An output layer computing the logits of `keep` ([N'] int64, increasing ids) only, with
    -inf at every other id of the `vocab` columns the full layer had: `inner` is an nn.Linear
    over the kept rows, on whatever kernel the model's linears run on."""

    def __init__(self, head: torch.nn.Linear, keep: torch.Tensor) -> None:
        super().__init__()
        weight = head.weight.detach()[keep].clone()  # a copy: the embedding keeps its own rows
        self.inner = torch.nn.Linear(
            weight.shape[1],
            weight.shape[0],
            bias=head.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            self.inner.weight.copy_(weight)
            if head.bias is not None:
                self.inner.bias.copy_(head.bias.detach()[keep])
        self.register_buffer("keep", keep.to(weight.device), persistent=False)
        self.vocab = int(head.weight.shape[0])
        self.in_features, self.out_features = int(weight.shape[1]), self.vocab

    def expand(self, kept: torch.Tensor) -> torch.Tensor:
        """[..., N'] logits of the kept ids -> [..., vocab], -inf elsewhere."""
        out = kept.new_full((*kept.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(out.dim() - 1, self.keep, kept)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., vocab]
        return self.expand(self.inner(hidden))

    def extra_repr(self) -> str:
        return f"keeps {self.keep.numel()} of {self.vocab} ids"


def kept_ids(
    vocab: int, size: int, tokenizer: Any = None, configs: Sequence[Any] = ()
) -> torch.Tensor:
    """The ids a draft vocabulary of `size` keeps out of `vocab`: 0 .. size-1, every special or
    added token of `tokenizer`, and the end/start/padding ids `configs` name (a model's config
    and its generation config). [N'] int64, increasing."""
    special: set[int] = set()
    if tokenizer is not None:
        special.update(getattr(tokenizer, "all_special_ids", None) or [])
        special.update((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    for config in configs:
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            value = getattr(config, name, None)
            special.update(value if isinstance(value, (list, tuple)) else [value])
    extra = sorted(i for i in special if isinstance(i, int) and size <= i < vocab)
    return torch.cat([torch.arange(min(size, vocab)), torch.tensor(extra, dtype=torch.long)])


def restrict_draft_vocab(loaded: Any, size: int | None) -> int | None:
    """Give `loaded`'s model (a LoadedModel, before its kernel and quantization) a draft
    vocabulary of `size` ids where its output layer is a plain nn.Linear with more rows than
    that; returns the number of ids kept, or None where nothing changed."""
    model = loaded.model
    head = getattr(model, "lm_head", None)
    if size is None or type(head) is not torch.nn.Linear or head.weight.shape[0] <= size:
        return None
    configs = [getattr(model, name, None) for name in ("config", "generation_config")]
    keep = kept_ids(head.weight.shape[0], size, loaded.tokenizer, configs)
    model.lm_head = DraftVocabHead(head, keep)
    print(
        f"{loaded.name}: the draft vocabulary, its output layer on {keep.numel()} of "
        f"{head.weight.shape[0]} ids (--draft-vocab all: every id)",
        file=sys.stderr,
        flush=True,
    )
    return int(keep.numel())


def kept_count(model: Any) -> int | None:
    """How many ids `model`'s output layer computes where it has a draft vocabulary, else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.keep.numel()) if isinstance(head, DraftVocabHead) else None
