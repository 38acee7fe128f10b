"""Log-probabilities of the generated tokens, as OpenAI's `logprobs` returns them.

They are the target's own: the log-softmax of its raw logits at each generated token (before
temperature, top-k and top-p, which shape what is drawn, not what the model thinks), taken from
the forwards that verified the tokens (`BatchSession.add(on_logits=...)`): no second forward.
A token that ends the generation as its EOS is not listed (it is no text); tokens a stop string
cut are not either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

MAX_TOP_CHAT = 20  # OpenAI's limits on the alternatives per token
MAX_TOP_COMPLETIONS = 5


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]]  # the `n` likeliest tokens and their logprobs, likeliest first


@dataclass
class LogprobCollector:
    """`on_logits` of one generation: keeps each committed token's log-probabilities until
    `take` pairs them with the tokens the step kept."""

    tokenizer: Any
    top_n: int
    skip_ids: frozenset[int] = frozenset()
    _pending: list[torch.Tensor] = field(default_factory=list)  # [V] float32 rows

    def __call__(self, logits: torch.Tensor) -> None:  # logits: [n, V], one row per token
        self._pending.extend(torch.log_softmax(logits.float(), dim=-1).unbind(0))

    def take(self, ids: list[int]) -> list[TokenLogprob]:
        """The entries of `ids`, the tokens the last commit kept (a stop string may have cut
        the rest: their rows are dropped)."""
        rows, self._pending = self._pending[: len(ids)], []
        entries = []
        for token, row in zip(ids, rows, strict=False):
            if token in self.skip_ids:
                continue
            top: list[tuple[str, float]] = []
            if self.top_n > 0:
                values, indices = torch.topk(row, self.top_n)
                pairs = zip(indices.tolist(), values.tolist(), strict=True)
                top = [(self._text(i), v) for i, v in pairs]
            entries.append(TokenLogprob(self._text(token), float(row[token]), top))
        return entries

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[0].logprobs` of a chat completion (or of one stream chunk)."""
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": _bytes(e.token),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top
                ],
            }
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """`choices[0].logprobs` of a completion (or of one stream chunk whose text starts at
    character `offset` of the completion)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }
