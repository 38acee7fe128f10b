"""The cache protocol (`Cache`) and its implementation over Hugging Face caches (`KVCache`):
a length, and one verb per cache move. The lean forward's `LeanCache` (lean.py) is the other one.

Invariant 2 (DESIGN.md): after every step the target's cache covers exactly the committed tokens
minus the last one, which is the next step's first input. Rollback is one call: `rollback(length)`;
after a token tree, `compact(keep)` moves the accepted path next to the prefix and drops the rest.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import cache as memoize
from typing import Any, Protocol

import torch


class Cache(Protocol):
    """One model's cache for a single sequence, and the model's forward over it."""

    model: Any

    def __len__(self) -> int: ...

    def rollback(self, length: int) -> None: ...

    def compact(self, keep: list[int] | torch.Tensor) -> None: ...

    def copy(self) -> Cache: ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] int64
        last_only: bool = False,
        *,
        position_ids: torch.Tensor | None = None,  # [n]
        attention_mask: torch.Tensor | None = None,  # [1, 1, n, len + n]
    ) -> torch.Tensor: ...  # logits [n, V] ([1, V] with last_only); the cache grows by n

    def close(self) -> None:
        """Give the cache's memory back (a store row returns to its store). Default: nothing."""

    @classmethod
    def forward_many(
        cls,
        caches: Sequence[Cache],
        inputs: Sequence[torch.Tensor],  # one [n_b] int64 per cache
        *,
        last_only: bool = False,
        positions: Sequence[torch.Tensor | None],  # one [n_b] or None per cache
        masks: Sequence[torch.Tensor | None],  # one [1, 1, n_b, len_b + n_b] or None per cache
    ) -> list[torch.Tensor]:
        """Several caches of this class forwarded together, each as its own `forward` would;
        a class that can share one pass over the weights overrides it. Default: one by one."""
        return [
            cache.forward(ids, last_only, position_ids=pos, attention_mask=mask)
            for cache, ids, pos, mask in zip(caches, inputs, positions, masks, strict=True)
        ]


# model -> an empty cache for it (KVCache, or lean.target_cache where the target runs lean)
NewCache = Callable[[Any], Cache]

# a target whose caches keep its features holds its FeatureTaps under this attribute
_FEATURES_FLAG = "_specdecode_keeps_features"


class FeatureTaps:
    """Where a feature-keeping model's hooks leave the hidden states of its last forward.

    `layers` are hidden-state indices as Hugging Face's `output_hidden_states` numbers them:
    i < L is the residual stream entering decoder layer i (0: the embeddings), L (the layer
    count) the final norm's output, what the output layer reads. A position's feature is the
    tapped states side by side: [len(layers) * D]. An EAGLE-3 head reads three layers
    (models/eagle_head.py); its training adds L, for the target's own distribution.
    """

    def __init__(self, layers: tuple[int, ...], hidden: int) -> None:
        self.layers = layers  # an index may repeat (a small target's head reads one twice)
        self.width = len(layers) * hidden
        self._states: dict[int, torch.Tensor] = {}

    def put(self, layer: int, states: torch.Tensor) -> None:
        self._states[layer] = states

    def take(self) -> torch.Tensor | None:
        """The last forward's features, [..., n, width] (the tapped states concatenated), or
        None where no forward ran since the last take; the taps are then empty."""
        if len(self._states) < len(set(self.layers)):
            self._states.clear()
            return None
        out = torch.cat([self._states[i] for i in self.layers], dim=-1)
        self._states.clear()
        return out


def keep_features(model: Any, layers: tuple[int, ...] | None = None) -> FeatureTaps:
    """Make every cache made over `model` from now on keep its features at hidden-state indices
    `layers` (FeatureTaps; None: the final norm's output alone), one row per cached position,
    as `cache.features()` [len, width]. A drafter fed the target's own hidden states (an
    EAGLE-3 head, drafters/eagle.py) asks for them; other caches skip the copy. Over Hugging
    Face's forward (KVCache, the static store) hooks on the decoder layers and the final norm
    hand them over, no forked model code; the lean forward taps its own loop (models/lean.py).
    A model keeps one set: asking for another is a ValueError."""
    base = model.get_decoder()
    count = len(base.layers)
    layers = tuple(layers) if layers is not None else (count,)
    taps = tapped_features(model)
    if taps is not None:
        if taps.layers != layers:
            raise ValueError(
                f"this target already keeps the features of hidden states {list(taps.layers)}, "
                f"not {list(layers)}: load it again for another head"
            )
        return taps
    if not layers or any(not 0 <= i <= count for i in layers):
        raise ValueError(
            f"hidden-state indices {list(layers)} for a target of {count} layers: from 0 (the "
            f"embeddings) to {count} (the final norm's output)"
        )
    taps = FeatureTaps(layers, model.config.hidden_size)
    for index in sorted(set(layers)):
        if index == count:
            base.norm.register_forward_hook(lambda m, a, out: taps.put(count, out))
        else:
            base.layers[index].register_forward_pre_hook(
                _layer_input(taps, index), with_kwargs=True
            )
    setattr(model, _FEATURES_FLAG, taps)
    return taps


def _layer_input(taps: FeatureTaps, index: int) -> Callable[..., None]:
    """A pre-hook keeping the hidden states a decoder layer is called with (its residual
    stream input: positional or `hidden_states=`)."""

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        taps.put(index, args[0] if args else kwargs["hidden_states"])

    return hook


def keeps_features(model: Any) -> bool:
    return tapped_features(model) is not None


def tapped_features(model: Any) -> FeatureTaps | None:
    """The FeatureTaps of a feature-keeping model, or None for a model that keeps none."""
    return getattr(model, _FEATURES_FLAG, None)


def feature_width(model: Any) -> int:
    """The width of one position's feature on a feature-keeping model (0 on another)."""
    taps = tapped_features(model)
    return taps.width if taps is not None else 0


def forward_rows(
    caches: Sequence[Cache],
    inputs: Sequence[torch.Tensor],  # one [n_b] int64 per cache
    *,
    last_only: bool = False,
    positions: Sequence[torch.Tensor | None] | None = None,  # one [n_b] or None per cache
    masks: Sequence[torch.Tensor | None] | None = None,  # one [1, 1, n_b, len_b + n_b] or None
) -> list[torch.Tensor]:
    """Several sequences' forwards as one: each cache grows by its own inputs and gets its own
    logits ([n_b, V], or [1, V] with `last_only`), exactly as `cache.forward` would give them.

    Caches of one class run through its `forward_many` (LeanCache, StoreRow: one pass over the
    model's weights for every row); a mix of classes runs cache by cache.
    """
    n = len(caches)
    positions = list(positions) if positions is not None else [None] * n
    masks = list(masks) if masks is not None else [None] * n
    if not n == len(inputs) == len(positions) == len(masks):
        raise ValueError("forward_rows needs one input, position and mask entry per cache")
    kind = type(caches[0]) if caches else None
    if n > 1 and all(type(c) is kind for c in caches):
        return kind.forward_many(  # type: ignore[union-attr]
            caches, inputs, last_only=last_only, positions=positions, masks=masks
        )
    return [
        cache.forward(ids, last_only, position_ids=pos, attention_mask=mask)
        for cache, ids, pos, mask in zip(caches, inputs, positions, masks, strict=True)
    ]


@memoize
def _forward_params(model_cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_cls.forward).parameters)


def cache_kwarg(model_cls: type) -> str:
    """The name a model's forward takes its cache by: `cache` in transformers 5.x,
    `past_key_values` in 4.x."""
    return "cache" if "cache" in _forward_params(model_cls) else "past_key_values"


class KVCache(Cache):
    """One model's key/value cache for a single sequence (batch size 1)."""

    def __init__(self, model: Any) -> None:
        # slow import (transformers, ~1 s): the core is imported by the command line's parser
        from transformers import DynamicCache

        self.model = model
        self.hf = DynamicCache()
        self.cache_kwarg = cache_kwarg(type(model))
        self._can_trim_logits = "logits_to_keep" in _forward_params(type(model))
        # [capacity, W]: each cached position's feature (the first len(self) valid, as a
        # LeanCache's), where the model keeps features (keep_features); grown by doubling
        self._features: torch.Tensor | None = None
        self._tapped = tapped_features(model)
        if self._tapped is not None:
            self._features = torch.empty(0, self._tapped.width, dtype=model.dtype)

    def __len__(self) -> int:
        return self.hf.get_seq_length()

    def features(self) -> torch.Tensor:
        """[len, W]: the feature of every cached position (`keep_features`)."""
        if self._features is None:
            raise ValueError("this cache keeps no features: call cache.keep_features(model) first")
        return self._features[: len(self)]

    def rollback(self, length: int) -> None:
        """Forget every cached position at or after `length`."""
        n_drop = len(self) - length
        if n_drop < 0:
            raise ValueError(f"cannot roll back a cache of {len(self)} positions to {length}")
        if n_drop:
            self.hf.crop(-n_drop)  # a negative count drops that many positions (4.x and 5.x)

    def copy(self) -> KVCache:
        """An independent copy over the same model (one prompt's prefill reused by many runs)."""
        other = KVCache(self.model)
        for index, layer in enumerate(_layers(self.hf)):
            other.hf.update(layer.keys.clone(), layer.values.clone(), index)
        if self._features is not None:
            other._features = self._features.clone()
        return other

    def compact(self, keep: list[int] | torch.Tensor) -> None:
        """Keep only the cached positions `keep` (strictly increasing), moved to 0..len(keep)-1.

        The one cache move after a token tree: the accepted path's keys/values slide down next to
        the committed prefix and every other node is dropped. The unchanged leading run of `keep`
        stays in place; only the tail is gathered (O(tail), not O(cache)).
        """
        keep, run = compaction(keep, len(self))
        tail = keep[run:]  # [m - run]
        for layer in _layers(self.hf):
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [batch, heads, n, head_dim]
                if tail.numel():
                    # the gather copies before the write, so overlapping slots are safe
                    states[..., run : keep.numel(), :] = states[..., tail.to(states.device), :]
                setattr(layer, name, states[..., : keep.numel(), :])
        if self._features is not None and tail.numel():
            rows = self._features
            rows[run : keep.numel()] = rows[tail.to(rows.device)]  # gather, then write

    def forward(
        self,
        input_ids: torch.Tensor,
        last_only: bool = False,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model over new tokens appended to the cached ones; the cache grows by n.

        input_ids: [n] int64. Returns logits [n, V], or [1, V] for the last position only when
        `last_only` (prefill and drafting need no more: the output head over a 150k vocabulary
        is a large share of a small model's forward). A token tree passes its own position ids
        [n] and a 4D attention mask [1, 1, n, len(self) + n] (see tree.py).
        """
        kwargs: dict[str, Any] = {self.cache_kwarg: self.hf}
        if last_only and self._can_trim_logits:
            kwargs["logits_to_keep"] = 1
        if position_ids is not None:
            kwargs["position_ids"] = position_ids[None]  # [1, n]
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        past = len(self)
        out = self.model(input_ids=input_ids[None], use_cache=True, **kwargs)
        if self._tapped is not None:  # the features of the n new positions: [1, n, W]
            new = self._tapped.take()
            assert new is not None, "the forward ran every tapped layer"
            self._keep_features(past, new[0])
        logits = out.logits[0]  # [n, V] or [1, V]
        return logits[-1:] if last_only else logits

    def _keep_features(self, past: int, new: torch.Tensor) -> None:
        """Write the features [n, W] of positions past .. past + n (the buffer doubles)."""
        assert self._features is not None
        end = past + new.shape[0]
        if end > self._features.shape[0] or self._features.device != new.device:
            grown = new.new_empty(max(end, 2 * self._features.shape[0]), new.shape[1])
            grown[:past] = self._features[:past]
            self._features = grown
        self._features[past:end] = new.detach()


def compaction(keep: list[int] | torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Check a `compact` argument against a cache of n positions: keep as int64 [m] on the CPU
    and how many of its leading positions are already in place (keep[i] == i)."""
    keep = torch.as_tensor(keep, dtype=torch.long).cpu()  # [m]
    if keep.numel() and (bool((keep[1:] <= keep[:-1]).any()) or keep[0] < 0 or keep[-1] >= n):
        raise ValueError(f"keep must be increasing positions in [0, {n}) (got {keep.tolist()})")
    return keep, int((keep == torch.arange(keep.numel())).cumprod(0).sum())


def _layers(hf: Any) -> list[Any]:
    """The per-layer key/value holders of a DynamicCache (`.keys`/`.values`: [b, h, n, d])."""
    from transformers.cache_utils import DynamicLayer  # slow import (transformers, ~1 s)

    layers = getattr(hf, "layers", None)
    if layers is None:
        raise ValueError("compact needs a transformers cache with per-layer storage (5.x)")
    for layer in layers:
        # sliding-window or quantized layers keep more state than keys and values
        if type(layer) is not DynamicLayer:
            raise ValueError(f"compact supports plain dynamic layers, not {type(layer).__name__}")
    return [layer for layer in layers if layer.is_initialized]
