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
def _cache_kwarg(model_cls: type) -> str:
    """transformers 5.x names the forward's cache argument `cache`; 4.x `past_key_values`."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class KVCache:
    """One model's key/value cache for a single sequence (batch size 1)."""

    def __init__(self, model: Any) -> None:
        from transformers import DynamicCache

        self.model = model
        self.hf = DynamicCache()
        self._kwarg = _cache_kwarg(type(model))

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`."""
        n_drop = len(self) - length
        if n_drop < 0:
            raise ValueError(f"cannot roll back a cache of {len(self)} positions to {length}")
        if n_drop:
            self.hf.crop(-n_drop)  # a negative count drops that many positions (4.x and 5.x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the model over new tokens appended to the cached ones.

        input_ids: [n] int64. Returns logits [n, V]; the cache grows by n positions.
        """
        out = self.model(input_ids=input_ids[None], use_cache=True, **{self._kwarg: self.hf})
        return out.logits[0]
