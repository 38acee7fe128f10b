"""The cache protocol over Hugging Face caches: a length, and one verb to roll back.

Invariant 2 (DESIGN.md): after every step the target's cache covers exactly the committed tokens
minus the last one, which is the next step's first input. Rollback is one call: `rollback(length)`.
"""

from __future__ import annotations

import inspect
from functools import cache as memoize
from typing import Any

import torch


@memoize
def _forward_params(model_cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_cls.forward).parameters)


class KVCache:
    """One model's key/value cache for a single sequence (batch size 1)."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self.hf = DynamicCache()
        params = _forward_params(type(model))
        # transformers 5.x names the cache argument `cache`, 4.x `past_key_values`
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._can_trim_logits = "logits_to_keep" in params

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`."""
        n_drop = len(self) - length
        if n_drop < 0:
            raise ValueError(f"cannot roll back a cache of {len(self)} positions to {length}")
        if n_drop:
            self.hf.crop(-n_drop)  # a negative count drops that many positions (4.x and 5.x)

    def forward(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Run the model over new tokens appended to the cached ones; the cache grows by n.

        input_ids: [n] int64. Returns logits [n, V], or [1, V] for the last position only when
        `last_only` (prefill and drafting need no more: the output head over a 150k vocabulary
        is a large share of a small model's forward).
        """
        kwargs = {self._cache_kwarg: self.hf}
        if last_only and self._can_trim_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids[None], use_cache=True, **kwargs)
        logits = out.logits[0]  # [n, V] or [1, V]
        return logits[-1:] if last_only else logits
