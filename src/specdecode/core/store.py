"""The static key/value store: one model's cache for many sequences, preallocated.

Each layer's keys and values live in [rows, Hkv, max_len + 1, d] tensors made once (the last
position is scratch: where the keys of padded queries that would pass max_len land); a sequence
owns a row and a length. Keys and values are written by position, a rollback sets the row's length
(no copy, no crop), a token tree's compaction is a gather within the row. A batch of rows runs
through the Hugging Face model's own forward (no forked model code) with per-row position ids
and a 4D mask that shows each row its own valid positions, so ragged rows (different lengths,
different numbers of new tokens) share one forward. Static shapes are also what a GPU's CUDA
graphs want; nothing here reads a tensor back to the host.

Supported attention: implementations that add a custom 4D mask as given (`tree.TREE_ATTENTION`:
eager and sdpa) and no sliding window; others are refused when the store is made.

The lean forward's store (`lean.LeanStore`) is the same idea in its own cache layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdecode.core.cache import (
    Cache,
    FeatureTaps,
    cache_kwarg,
    compaction,
    tapped_features,
)
from specdecode.core.tree import additive_mask, check_tree_attention


class StoreFull(RuntimeError):
    """Every row of a store is taken, or a row would grow past the store's `max_len`."""


def kv_shape(model: Any) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a decoder model's attention, from its config."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return int(layers), int(kv_heads), int(head_dim)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes the given tensors hold (None counts nothing)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class RowPool:
    """Which rows of a store are taken: what StaticStore and LeanStore share."""

    def __init__(self, rows: int, max_len: int) -> None:
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"a store needs at least one row (got {rows!r})")
        if not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"a store's max_len must be an integer >= 2 (got {max_len!r})")
        self.rows, self.max_len = rows, max_len
        self._free = list(range(rows))  # in the order they were freed: row 0 first

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def free_order(self) -> list[int]:
        """The free rows, the one freed longest ago first."""
        return list(self._free)

    def take(self, row: int | None = None) -> int:
        """Take `row` (a free one), or by default the one freed longest ago."""
        if not self._free:
            raise StoreFull(f"all {self.rows} rows of the key/value store are in use")
        if row is None:
            return self._free.pop(0)
        if row not in self._free:
            raise ValueError(f"row {row} is not free")
        self._free.remove(row)
        return row

    def give_back(self, row: int) -> None:
        if row in self._free or not 0 <= row < self.rows:
            raise ValueError(f"row {row} is not taken")
        self._free.append(row)


class StaticStore(RowPool):
    """A Hugging Face model's preallocated key/value store for `rows` sequences of up to
    `max_len` positions each; `open_row()` hands out a row as a `Cache` (`StoreRow`)."""

    def __init__(self, model: Any, rows: int, max_len: int) -> None:
        super().__init__(rows, max_len)
        # the store's rows are fed a custom 4D mask
        check_tree_attention(model, "target", "batched rows (the static key/value store)")
        self.model = model
        param = next(model.parameters())
        layers, kv_heads, head_dim = kv_shape(model)
        shape = (rows, kv_heads, max_len + 1, head_dim)  # + 1: the padding's scratch position
        make = lambda: torch.zeros(shape, dtype=param.dtype, device=param.device)  # noqa: E731
        self.keys = [make() for _ in range(layers)]  # [rows, Hkv, max_len + 1, d] per layer
        self.values = [make() for _ in range(layers)]
        self.lengths = [0] * rows
        # [rows, max_len + 1, W]: each position's feature where the model keeps them
        # (cache.keep_features), read through the hooks KVCache reads too
        self.tapped: FeatureTaps | None = tapped_features(model)
        self.features: torch.Tensor | None = None
        if self.tapped is not None:
            size = (rows, max_len + 1, self.tapped.width)
            self.features = torch.zeros(size, dtype=param.dtype, device=param.device)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds (keys and values of every layer, and features if kept)."""
        return tensor_bytes(*self.keys, *self.values, self.features)

    def _states(self) -> list[torch.Tensor]:
        """Every per-row tensor a row's positions live in: [rows, ..., max_len + 1, ...]."""
        return [*self.keys, *self.values]

    def open_row(self, tokens: Sequence[int] = (), parts: int | None = None) -> StoreRow:
        """An empty row (StoreFull when every row is taken); `StoreRow.close()` frees it.
        `tokens` (the sequence's start) and `parts` are not used: only the lean store keeps
        prefixes."""
        row = self.take()
        self.lengths[row] = 0
        return StoreRow(self, row)


class StoreRow(Cache):
    """One sequence's row of a StaticStore, with the Cache protocol (cache.py)."""

    def __init__(self, store: StaticStore, row: int) -> None:
        self.store, self.row, self.model = store, row, store.model
        self.closed = False

    def __len__(self) -> int:
        return self.store.lengths[self.row]

    def features(self) -> torch.Tensor:
        """[len, W]: the feature of every cached position (`keep_features`)."""
        if self.store.features is None:
            raise ValueError("this cache keeps no features: call cache.keep_features(model) first")
        return self.store.features[self.row, : len(self)]

    def close(self) -> None:
        """Give the row back to the store (its keys stay until overwritten)."""
        if not self.closed:
            self.closed = True
            self.store.give_back(self.row)

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`: the row's length, nothing moved."""
        if not 0 <= length <= len(self):
            raise ValueError(f"cannot roll back a cache of {len(self)} positions to {length}")
        self.store.lengths[self.row] = length

    @torch.inference_mode()
    def compact(self, keep: list[int] | torch.Tensor) -> None:
        """Keep only the cached positions `keep` (strictly increasing), moved to 0..len(keep)-1:
        a gather within the row for the positions not already in place."""
        keep, run = compaction(keep, len(self))
        tail = keep[run:]
        if tail.numel():
            for states in self.store._states():
                row = states[self.row]  # [Hkv, max_len, d]
                row[:, run : keep.numel()] = row[:, tail.to(row.device)]  # gather, then write
            if self.store.features is not None:
                row = self.store.features[self.row]  # [max_len, W]
                row[run : keep.numel()] = row[tail.to(row.device)]
        self.store.lengths[self.row] = keep.numel()

    def copy(self) -> StoreRow:
        """Another row of the same store holding the same positions (StoreFull if none)."""
        twin = self.store.open_row()
        n = len(self)
        for states in self.store._states():
            states[twin.row, :, :n] = states[self.row, :, :n]
        if self.store.features is not None:
            self.store.features[twin.row, :n] = self.store.features[self.row, :n]
        self.store.lengths[twin.row] = n
        return twin

    def forward(
        self,
        input_ids: torch.Tensor,
        last_only: bool = False,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Cache.forward over this row: logits [n, V] ([1, V] with `last_only`)."""
        return StoreRow.forward_many(
            [self],
            [input_ids],
            last_only=last_only,
            positions=[position_ids],
            masks=[attention_mask],
        )[0]

    @classmethod
    @torch.inference_mode()
    def forward_many(
        cls,
        rows: Sequence[StoreRow],
        inputs: Sequence[torch.Tensor],  # one [n_b] int64 per row
        *,
        last_only: bool = False,
        positions: Sequence[torch.Tensor | None],  # one [n_b] or None (the next n_b) per row
        masks: Sequence[torch.Tensor | None],  # one [1, 1, n_b, len_b + n_b] or None (causal)
    ) -> list[torch.Tensor]:
        """One forward of the model over several rows' new tokens (cache.forward_rows).

        The batch is padded to the longest row's n; a padded query attends causally (its output
        is dropped) and its key lands beyond the row's length, where the next write overwrites it
        (past max_len: on the scratch position, which no query reads). So a row needs room for
        its own inputs only, whatever the other rows feed.
        """
        store = rows[0].store
        if any(r.store is not store or r.closed for r in rows):
            raise ValueError("forward_many needs open rows of one store")
        device = store.keys[0].device
        sizes = [int(ids.shape[0]) for ids in inputs]
        pasts = [len(r) for r in rows]
        n = max(sizes)
        for past, size in zip(pasts, sizes, strict=True):
            if past + size > store.max_len:
                raise StoreFull(
                    f"a sequence of {past + size} positions does not fit the store's "
                    f"max_len of {store.max_len}"
                )
        span = min(max(pasts) + n, store.max_len)  # key positions the forward attends over
        ids = torch.zeros(len(rows), n, dtype=torch.long, device=device)  # [B, n]
        pos = torch.empty(len(rows), n, dtype=torch.long, device=device)  # [B, n]
        allowed = torch.zeros(len(rows), n, span, dtype=torch.bool, device=device)  # [B, n, L]
        steps = torch.arange(n, device=device)
        for b, (x, p, m, past, size) in enumerate(
            zip(inputs, positions, masks, pasts, sizes, strict=True)
        ):
            ids[b, :size] = x.to(device)
            pos[b] = past + steps  # padding continues the row's positions
            if p is not None:
                pos[b, :size] = p.to(device)
            # every query sees the row's prefix and, causally, the forward's own keys ...
            width = min(past + n, span)
            allowed[b, :, :width] = torch.arange(width, device=device) <= past + steps[:, None]
            if m is not None:  # ... unless the caller's mask (a token tree) says otherwise
                given = m.reshape(size, past + size).to(device)
                allowed[b, :size, : past + size] = (
                    given if given.dtype == torch.bool else given == 0
                )
        view = _RowsView(store, [r.row for r in rows], pasts, n, span)
        param = next(store.model.parameters())
        out = store.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=additive_mask(allowed, param.dtype)[0, 0, :, None],  # [B, 1, n, L]
            use_cache=True,
            **{view.cache_kwarg: view},
        )
        for r, past, size in zip(rows, pasts, sizes, strict=True):
            store.lengths[r.row] = past + size
        tapped = store.tapped.take() if store.tapped is not None else None
        if tapped is not None:  # the features, [B, n, W]: each row's own positions
            for b, (r, past, size) in enumerate(zip(rows, pasts, sizes, strict=True)):
                store.features[r.row, past : past + size] = tapped[b, :size]  # type: ignore[index]
        logits = out.logits  # [B, n, V]
        if last_only:
            return [logits[b, size - 1 : size] for b, size in enumerate(sizes)]
        return [logits[b, :size] for b, size in enumerate(sizes)]


class _RowsView:
    """What the Hugging Face model sees as its cache for one forward over some rows of a store:
    `update` writes the new keys/values by position and returns each row's first `span`
    positions ([B, Hkv, span, d]; the mask hides what a row does not own)."""

    def __init__(self, store: StaticStore, rows: list[int], pasts: list[int], n: int, span: int):
        self.store, self.span = store, span
        device = store.keys[0].device
        self.rows = torch.tensor(rows, device=device)  # [B]
        # [B, n]: where each new key goes; padding past max_len onto the scratch position
        slots = torch.tensor(pasts, device=device)[:, None] + torch.arange(n, device=device)
        self.slots = slots.clamp(max=store.max_len)
        first = rows[0]
        # rows first, first + 1, ...: a slice of the store, no gather
        self.contiguous = rows == list(range(first, first + len(rows)))
        self._slice = slice(first, first + len(rows))
        self.cache_kwarg = cache_kwarg(type(store.model))

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: [B, Hkv, n, d] -> the rows' keys and values [B, Hkv, span, d]."""
        out = []
        for states, new in (
            (self.store.keys[layer_idx], keys),
            (self.store.values[layer_idx], values),
        ):
            # advanced indices around a slice: the indexed view is [B, n, Hkv, d]
            states[self.rows[:, None], :, self.slots] = new.transpose(1, 2).to(states.dtype)
            if self.contiguous:
                out.append(states[self._slice, :, : self.span])
            else:
                out.append(states.index_select(0, self.rows)[:, :, : self.span])
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span
