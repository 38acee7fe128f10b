"""Pruned targets without retraining: whole decoder layers dropped, MLP channels removed.

Both choose what to remove from calibration text (token-id sequences the caller gives: the bench
suite's prompts and the target's own answers, bench/variants.py) and change a copy of the model
whose untouched tensors are the original's (`shared_copy`), so a variant costs only what it
changes.

- **Depth** (`drop_layers`): the block influence of decoder layer i is
  BI_i = 1 - mean over tokens of cos(h_in, h_out), its input and output hidden states (ShortGPT,
  Men et al. 2024); the n layers with the lowest BI are dropped, the rest renumbered.
- **Width** (`prune_mlp`): MLP channel j of a layer is scored ||X_j||_2 * ||W_down[:, j]||_1, X_j
  the activation SiLU(gate_j) * up_j that down_proj reads over all calibration tokens (Wanda's
  |W| * ||X|| summed over the column the channel feeds, Sun et al. 2023); the lowest-scoring
  channels of every layer go: gate_proj and up_proj rows and down_proj columns are removed and
  `config.intermediate_size` shrinks.

Llama-style decoders only (Llama, Qwen2, Mistral: `model.model.layers`, an `mlp` with
`gate_proj` / `up_proj` / `down_proj`); others get a ValueError naming what is needed.
Deterministic: the same model and text give the same choice (ties go to the lower index).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from specdecode.kernels.cpu_linear import swap_linears
from specdecode.kernels.panels import on_kernel, row_major

PANEL = 16  # kept MLP widths are rounded to whole panels of the kernels (kernels/panels.py)


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` (its own modules and config) holding the same parameter and buffer
    tensors: changing the copy's structure leaves the original as it is, for no extra memory."""
    memo = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return copy.deepcopy(model, memo)


def decoder_layers(model: Any, what: str) -> torch.nn.ModuleList:
    """`model`'s decoder layers (Llama style), or a ValueError saying `what` needs them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not all(
        hasattr(layer, "self_attn") for layer in layers
    ):
        raise ValueError(
            f"{what} needs a Llama-style decoder (Llama, Qwen2, Mistral: model.model.layers with "
            f"self_attn); {type(model).__name__} is not one"
        )
    return layers


def gated_mlps(model: Any) -> list[Any]:
    """Every layer's MLP, or a ValueError where they are not gated (gate/up/down_proj)."""
    layers = decoder_layers(model, "prune-mlp")
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if not all(
        all(hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj")) for m in mlps
    ):
        raise ValueError(
            f"prune-mlp needs gated MLPs (gate_proj, up_proj, down_proj) in every layer; "
            f"{type(model).__name__} has other MLPs"
        )
    return mlps


def _run(model: Any, sequences: Sequence[Sequence[int]]) -> None:
    """One forward per calibration sequence (no cache, only the last logits: hooks collect)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        for ids in sequences:
            tensor = torch.tensor([list(ids)], device=device)  # [1, S]
            model(input_ids=tensor, use_cache=False, logits_to_keep=1)


def _weight(linear: torch.nn.Linear) -> torch.Tensor:
    """A linear's weight [N, K] in its usual layout (also while packed in the kernels' panels)."""
    return row_major(linear).detach()


# -- depth --------------------------------------------------------------------------------------


def block_influence(model: Any, sequences: Sequence[Sequence[int]]) -> list[float]:
    """BI per decoder layer: 1 - the mean cosine similarity of each token's hidden state before
    and after the layer, over every token of `sequences` (float32)."""
    layers = decoder_layers(model, "drop-layers")
    if not sequences:
        raise ValueError("block influence needs calibration text (no sequences given)")
    cos_sum = [0.0] * len(layers)
    tokens = [0] * len(layers)

    def hook(index: int):
        def record(module, args, kwargs, output) -> None:
            h_in = args[0] if args else kwargs["hidden_states"]  # [1, S, H]
            h_out = output[0] if isinstance(output, tuple) else output  # [1, S, H]
            cos = torch.nn.functional.cosine_similarity(h_in.float(), h_out.float(), dim=-1)
            cos_sum[index] += float(cos.sum())
            tokens[index] += cos.numel()

        return record

    handles = [
        layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    try:
        _run(model, sequences)
    finally:
        for handle in handles:
            handle.remove()
    return [1.0 - s / n for s, n in zip(cos_sum, tokens, strict=True)]


def least_influence(scores: Sequence[float], n: int) -> list[int]:
    """The indices of the `n` lowest scores, ascending (ties: the lower index first)."""
    order = sorted(range(len(scores)), key=lambda i: (scores[i], i))
    return sorted(order[:n])


def check_drop_count(model: Any, n: int) -> int:
    """The decoder's layer count, or a ValueError where dropping `n` layers is not allowed."""
    count = len(decoder_layers(model, "drop-layers"))
    if not 1 <= n < count:
        raise ValueError(
            f"drop-layers={n}: this model has {count} decoder layers; drop between 1 and "
            f"{count - 1} of them"
        )
    return count


def drop_layers(model: Any, dropped: Sequence[int]) -> None:
    """Remove the decoder layers `dropped` from `model` in place; the rest keep their order and
    are renumbered (their attention's `layer_idx` indexes the cache) and the config follows."""
    layers = decoder_layers(model, "drop-layers")
    check_drop_count(model, len(set(dropped)))
    kept = [layer for i, layer in enumerate(layers) if i not in set(dropped)]
    for new_index, layer in enumerate(kept):
        layer.self_attn.layer_idx = new_index
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = new_index
    model.model.layers = torch.nn.ModuleList(kept)
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        config.layer_types = [t for i, t in enumerate(layer_types) if i not in set(dropped)]
    config.num_hidden_layers = len(kept)


# -- width --------------------------------------------------------------------------------------


def kept_channels(width: int, fraction: float) -> int:
    """How many of `width` MLP channels stay when `fraction` of them go: width * (1 - fraction),
    rounded to whole kernel panels of 16 where the width allows it, never 0 nor all of them."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"prune-mlp takes a fraction in (0, 1) (got {fraction})")
    keep = round(width * (1.0 - fraction))
    if width >= 2 * PANEL:
        keep = max(PANEL, round(keep / PANEL) * PANEL)
    keep = min(max(keep, 1), width - 1)
    if keep < 1:
        raise ValueError(f"prune-mlp={fraction}: an MLP of width {width} cannot lose channels")
    return keep


def mlp_channel_scores(model: Any, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per layer, each MLP channel's ||X_j||_2 * ||W_down[:, j]||_1 (float32 [I]) over every
    token of `sequences`, X the input of down_proj."""
    mlps = gated_mlps(model)
    if not sequences:
        raise ValueError("channel scores need calibration text (no sequences given)")
    squares = [torch.zeros(m.down_proj.in_features, dtype=torch.float64) for m in mlps]

    def hook(index: int):
        def record(module, args) -> None:
            x = args[0].float().reshape(-1, args[0].shape[-1])  # [S, I]
            squares[index] += x.square().sum(0).double().cpu()

        return record

    handles = [m.down_proj.register_forward_pre_hook(hook(i)) for i, m in enumerate(mlps)]
    try:
        _run(model, sequences)
    finally:
        for handle in handles:
            handle.remove()
    scores = []
    for m, sq in zip(mlps, squares, strict=True):
        column_l1 = _weight(m.down_proj).float().abs().sum(0).cpu()  # [I]
        scores.append(sq.sqrt().float() * column_l1)
    return scores


def top_channels(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The `keep` highest-scoring channels' indices, ascending (ties: the lower index)."""
    order = torch.sort(-scores.float(), stable=True).indices  # stable: equal scores keep order
    return order[:keep].sort().values


def _sliced(linear: torch.nn.Linear, index: torch.Tensor, dim: int) -> torch.nn.Linear:
    """A new linear holding `linear`'s output rows (dim 0) or input columns (dim 1) `index`."""
    weight = _weight(linear).index_select(dim, index.to(linear.weight.device)).contiguous()
    out_features, in_features = weight.shape
    bias = linear.bias
    new = torch.nn.Linear(
        in_features, out_features, bias=bias is not None, dtype=weight.dtype, device=weight.device
    )
    with torch.no_grad():
        new.weight.copy_(weight)
        if bias is not None:
            new.bias.copy_(bias if dim == 1 else bias.index_select(0, index.to(bias.device)))
    new.requires_grad_(False)
    return new


def prune_mlp(model: Any, keep: Sequence[torch.Tensor]) -> None:
    """Keep only channels `keep[i]` (equal counts) of layer i's MLP, in place: new, smaller
    gate_proj / up_proj (rows) and down_proj (columns); linears on the CPU kernels stay there."""
    mlps = gated_mlps(model)
    widths = {int(index.numel()) for index in keep}
    if len(keep) != len(mlps) or len(widths) != 1:
        raise ValueError("prune_mlp keeps the same number of channels in every layer")
    for mlp, index in zip(mlps, keep, strict=True):
        on = on_kernel(mlp.down_proj)
        mlp.gate_proj = _sliced(mlp.gate_proj, index, 0)
        mlp.up_proj = _sliced(mlp.up_proj, index, 0)
        mlp.down_proj = _sliced(mlp.down_proj, index, 1)
        if on:
            swap_linears(mlp)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = int(index.numel())
    model.config.intermediate_size = widths.pop()
