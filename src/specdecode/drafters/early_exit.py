"""Early-exit (self-speculative) drafting: the target's first n layers, its final norm and head.

The draft model is a thin view of the target: a shallow copy whose decoder-layer list holds the
first n layer modules of the target and whose norm, embeddings and head are the target's own
modules — the weights are shared, never copied. It keeps its own cache for those n layers.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from specdecode.drafters.model import ModelDrafter

# base-model attribute holding the decoder layers, per supported family
_LAYER_LISTS = ("layers", "h")
# config fields that count layers or describe each layer
_DEPTH_FIELDS = ("num_hidden_layers", "n_layer")
_PER_LAYER_FIELDS = ("layer_types",)


def _layer_list(base: nn.Module) -> tuple[str, nn.ModuleList]:
    for name in _LAYER_LISTS:
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return name, layers
    raise ValueError(
        f"early-exit drafting supports Llama/Qwen2/Mistral/GPT-2-style models; "
        f"{type(base).__name__} has no decoder layer list"
    )


def early_exit_model(target: Any, n_layers: int) -> Any:
    """A model running only the target's first `n_layers` layers, sharing all its weights."""
    prefix = getattr(target, "base_model_prefix", "")
    base = getattr(target, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        raise ValueError(f"early-exit drafting is not supported for {type(target).__name__}")
    layers_name, layers = _layer_list(base)
    if not 1 <= n_layers < len(layers):
        raise ValueError(
            f"early-exit depth must be between 1 and {len(layers) - 1} for this target "
            f"({len(layers)} layers), got {n_layers}"
        )
    config = copy.deepcopy(target.config)
    for name in _DEPTH_FIELDS:
        if hasattr(config, name):
            setattr(config, name, n_layers)
    for name in _PER_LAYER_FIELDS:
        if isinstance(getattr(config, name, None), list):
            setattr(config, name, getattr(config, name)[:n_layers])

    view_base = copy.copy(base)  # shallow: the same parameter tensors
    view_base._modules = dict(base._modules)
    view_base._modules[layers_name] = nn.ModuleList(list(layers)[:n_layers])
    view_base.config = config
    view = copy.copy(target)
    view._modules = dict(target._modules)
    view._modules[prefix] = view_base
    view.config = config
    return view


class EarlyExitDrafter(ModelDrafter):
    """`early-exit:N`: draft with the target's first N layers (no extra weights in memory)."""

    def __init__(self, target: Any, n_layers: int, confidence: float | None = None) -> None:
        head = target.get_output_embeddings()
        super().__init__(
            early_exit_model(target, n_layers),
            vocab_size=int(head.weight.shape[0]),
            name=f"early-exit:{n_layers}",
            confidence=confidence,
        )
