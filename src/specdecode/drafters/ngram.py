"""Prompt lookup (n-gram) drafting: no model, just the text already there.

Editing, summarization, extraction and RAG answers repeat spans of their prompt. The drafter
looks for the most recent earlier occurrence of the context's last n tokens (n from `max_ngram`
down to `min_ngram`) and proposes the k tokens that followed it. The proposal is deterministic
(`q_draft = None`), which verification treats as one-hot, so sampling stays lossless.
"""

from __future__ import annotations

import torch

from specdecode.core.protocols import Drafter
from specdecode.core.sampling import SamplingParams
from specdecode.core.types import Draft, ForwardMeter


class NgramDrafter(Drafter):
    # c, the draft's cost per token next to the target's (policies.prior_cost_ratio): no model
    # forward, so next to nothing
    cost_ratio = 0.0

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"n-gram sizes need 1 <= min <= max (got min {min_ngram}, max {max_ngram})"
            )
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.name = f"ngram:{min_ngram}-{max_ngram}"
        self._ids = torch.empty(0, dtype=torch.long)

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        meter: ForwardMeter,
    ) -> None:
        self._ids = torch.tensor(prompt_ids, dtype=torch.long)

    def _sync(self, context: list[int]) -> torch.Tensor:
        """The context as a tensor, appending only what is new since the last call."""
        known = self._ids.shape[0]
        if known > len(context):
            self._ids = torch.tensor(context, dtype=torch.long)
        elif known < len(context):
            self._ids = torch.cat([self._ids, torch.tensor(context[known:], dtype=torch.long)])
        return self._ids

    def propose(self, context: list[int], k: int) -> Draft:
        return Draft(lookup(self._sync(context), k, self.min_ngram, self.max_ngram))

    def observe(self, n_accepted: int) -> None:
        pass  # stateless beyond the context, which the next propose() receives in full


def lookup(ids: torch.Tensor, k: int, min_ngram: int, max_ngram: int) -> torch.Tensor:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens of
    `ids` ([L] int64), n from `max_ngram` down to `min_ngram`; empty where none occurred."""
    length = ids.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = ids[length - n :]  # [n]
        # every earlier window of n tokens, vectorised: windows[i] = ids[i : i + n]
        windows = ids[: length - 1].unfold(0, n, 1)  # [L - n, n]
        hits = (windows == suffix).all(dim=1).nonzero()  # [hits, 1]
        if hits.numel():
            start = int(hits[-1]) + n  # the most recent match; what followed it
            return ids[start : start + k].clone()
    return torch.empty(0, dtype=torch.long)
