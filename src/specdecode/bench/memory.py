"""Memory a method needs: measured on CUDA, computed from the models on the CPU.

On CUDA the peak of allocated memory is read per generation. On the CPU no allocator reports a
per-run peak (the process RSS only grows), so the record carries the exact sum of what a run must
hold: the weights of every model it uses (shared tensors counted once) plus the key/value caches
of the tokens it processed. Records say which of the two they carry (`memory_source`).
"""

from __future__ import annotations

from typing import Any

import torch

from specdecode.models.lean import LeanCache, capacity_for, target_cache


def weights_bytes(*models: Any) -> int:
    """Bytes of the parameters and buffers of `models`, each storage counted once (a freed
    weight, on the meta device, holds none)."""
    seen: set[int] = set()
    total = 0
    for model in models:
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_meta:  # a quantized target's freed bfloat16 weight: no storage
                continue
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += tensor.untyped_storage().nbytes()
    return total


def kv_bytes_per_token(model: Any, layers: int | None = None, element: int | None = None) -> int:
    """Bytes one token adds to `model`'s key/value cache (keys and values, every layer), in the
    model's dtype or `element` bytes per number."""
    config = model.config
    config = getattr(config, "text_config", config)
    n_layers = layers if layers is not None else config.num_hidden_layers
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    element = element or next(model.parameters()).element_size()
    return 2 * n_layers * kv_heads * head_dim * element


def estimate_bytes(
    target: Any,
    draft: Any | None,
    n_tokens: int,
    lean_draft: bool = False,
    lean_target: bool = False,
) -> int:
    """Weights of target (and draft model) + their caches over `n_tokens` (prompt + new).

    `draft` is the draft's model (an early-exit view shares the target's weights, so only its
    cache over its own layers counts) or None for the target alone and model-free drafters. A
    model on the lean forward (`lean_draft`, `lean_target`: lean.py) holds a float32 cache of
    `capacity_for(n)` positions instead of the model's own.
    """
    total = weights_bytes(target) + _cache_bytes(target, None, n_tokens, lean_target)
    if isinstance(draft, torch.nn.Module):
        total += weights_bytes(draft) - _shared_bytes(target, draft)
        total += _cache_bytes(draft, len(draft.model.layers), n_tokens, lean_draft)
    return total


def _cache_bytes(model: Any, layers: int | None, n_tokens: int, lean: bool) -> int:
    if lean:  # the lean forward's own cache: float32, preallocated
        return kv_bytes_per_token(model, layers, element=4) * capacity_for(n_tokens)
    return kv_bytes_per_token(model) * n_tokens


def decode_bytes(target: Any, drafter: Any | None, n_tokens: int) -> int:
    """`estimate_bytes` of a decode by our engine: the target and the drafter (None: the target
    alone) each counted with the cache its forward holds (lean.target_cache / the drafter's)."""
    draft = getattr(drafter, "model", None)
    lean_draft = isinstance(getattr(drafter, "cache", None), LeanCache)
    lean_target = isinstance(target_cache(target), LeanCache)
    total = estimate_bytes(target, draft, n_tokens, lean_draft, lean_target)
    head = getattr(drafter, "head", None)  # an EAGLE-3 head (drafters/eagle.py)
    if head is not None:
        total += head_bytes(target, head, n_tokens, lean_target)
    return total


def head_bytes(target: Any, head: Any, n_tokens: int, lean_target: bool = False) -> int:
    """What an EAGLE-3 head adds over `n_tokens`: its weights (what it shares with the target
    counted once), its own one-layer cache, and the features the target's cache keeps (three
    hidden states a position, float32 in a lean cache, else the target's dtype)."""
    element = head.dtype.itemsize  # its cache's dtype (a quantized linear's weight: meta)
    config = getattr(target.config, "text_config", target.config)
    feature_element = 4 if lean_target else target.dtype.itemsize
    features = len(head.aux_layers) * config.hidden_size * feature_element * n_tokens
    cache = kv_bytes_per_token(head, layers=1, element=element) * n_tokens
    return weights_bytes(head) - _shared_bytes(target, head) + cache + features


def _shared_bytes(a: Any, b: Any) -> int:
    return weights_bytes(a) + weights_bytes(b) - weights_bytes(a, b)
