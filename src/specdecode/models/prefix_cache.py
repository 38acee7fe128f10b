"""Kept prefixes beyond a store's rows: host memory for the keys and values a freed row held
before another sequence took it (docs/architecture.md, "Prefix reuse").

A `LeanStore` keeps one prefix per free row (a system prompt, a chat's earlier turns, the same
prompt again), so a server that answers more distinct prompts than it has rows loses them as
rows are handed out again. `PrefixCache` copies what a row held, the positions a later prompt
may keep (computed on the fused path: `LeanCache.fused_len`), before the row is overwritten,
up to a budget in bytes, the least recently used dropped first; `LeanStore.open_row` copies the
longest match back into the row it hands out. The copies are the same bits, so an answer is the
one a fresh prefill gives (tests/test_prefix_reuse.py). This is what vLLM's automatic prefix
caching and llama-server's `--cache-ram` do for their own caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.core.store import tensor_bytes


def common_prefix(ids: torch.Tensor, tokens: Sequence[int] | torch.Tensor) -> int:
    """How many leading entries of `ids` ([n] int64) equal those of `tokens`."""
    n = min(int(ids.numel()), len(tokens))
    if n == 0:
        return 0
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.tensor(list(tokens[:n]), dtype=torch.long)
    differ = (ids[:n].cpu() != tokens[:n].cpu()).nonzero()
    return int(differ[0, 0]) if differ.numel() else n


@dataclass(eq=False)
class KeptPrefix:
    """One kept sequence: its token ids [n] and their keys and values [layers, 2, Hkv, n, d]
    (and features [n, W] where the model keeps them), copies of a store row's."""

    ids: torch.Tensor
    kv: torch.Tensor
    features: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.ids.numel())

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.ids, self.kv, self.features)


class PrefixCache:
    """At most `budget` bytes of kept prefixes, most recently used last. 0 keeps nothing."""

    def __init__(self, budget: int) -> None:
        if not isinstance(budget, int) or budget < 0:
            raise ValueError(
                f"a prefix cache's budget must be a number of bytes >= 0 (got {budget!r})"
            )
        self.budget = budget
        self._kept: list[KeptPrefix] = []
        self.nbytes = 0
        self.dropped = 0  # prefixes evicted for room

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, ids: torch.Tensor, kv: torch.Tensor, features: torch.Tensor | None) -> None:
        """Copy a row's first n positions (`ids` [n], `kv` [layers, 2, Hkv, >= n, d], `features`
        [>= n, W] or None). A prefix another kept one already covers only moves that one to
        the most recently used end; kept prefixes this one covers are dropped."""
        n = int(ids.numel())
        if n == 0:
            return
        for i, other in enumerate(self._kept):
            if len(other) >= n and common_prefix(other.ids, ids) == n:
                self._kept.append(self._kept.pop(i))
                return
        host = torch.device("cpu")  # a GPU's memory stays the store's
        entry = KeptPrefix(
            ids.to(host, copy=True),
            kv[:, :, :, :n].to(host, copy=True),
            features[:n].to(host, copy=True) if features is not None else None,
        )
        if entry.nbytes > self.budget:
            return
        covered = [k for k in self._kept if common_prefix(entry.ids, k.ids) == len(k)]
        for k in covered:
            self._remove(k)
        self._kept.append(entry)
        self.nbytes += entry.nbytes
        while self.nbytes > self.budget:
            self._remove(self._kept[0])
            self.dropped += 1

    def match(self, tokens: Sequence[int]) -> tuple[KeptPrefix | None, int]:
        """The kept prefix sharing the most leading positions with `tokens`, and how many
        (None, 0 when none shares any); the most recently used among equals."""
        best, length = None, 0
        tokens = torch.tensor(list(tokens), dtype=torch.long)
        for entry in reversed(self._kept):
            shared = common_prefix(entry.ids, tokens)
            if shared > length:
                best, length = entry, shared
        return best, length

    def restore(
        self,
        entry: KeptPrefix,
        n: int,
        kv: torch.Tensor,
        ids: torch.Tensor,
        features: torch.Tensor | None,
    ) -> None:
        """Copy `entry`'s first n positions into a row (`kv` [layers, 2, Hkv, max_len, d],
        `ids` [max_len], `features` [max_len, W] or None) and mark it used."""
        kv[:, :, :, :n] = entry.kv[:, :, :, :n].to(kv.device)
        ids[:n] = entry.ids[:n].to(ids.device)
        if features is not None and entry.features is not None:
            features[:n] = entry.features[:n].to(features.device)
        self._kept.remove(entry)
        self._kept.append(entry)

    def report(self) -> dict[str, int]:
        """What /metrics shows: prefixes, bytes held, the budget, prefixes dropped for room."""
        return {
            "prefixes": len(self._kept),
            "bytes": self.nbytes,
            "budget": self.budget,
            "dropped": self.dropped,
        }

    def _remove(self, entry: KeptPrefix) -> None:
        self._kept.remove(entry)
        self.nbytes -= entry.nbytes
