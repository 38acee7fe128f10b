"""Attention for decoding on CPU: a few query tokens against a cached prefix.

Why: for one query token against a few hundred cached ones, PyTorch's CPU SDPA kernel (flash
attention for CPU) spends most of its time per layer in set-up, and with a custom 4D mask (a
token tree) Hugging Face first copies every key/value head per query head (`repeat_kv`). Here
the few queries of each key/value head are stacked into one small float32 matmul against that
head's keys (grouped-query attention without copies), masked, soft-maxed and multiplied with
the values: in a profile of a one-token forward, a small part of SDPA's operator time per layer
(the whole forward's wall time moved within the machine's noise;
docs/results.md). Calls with more than MAX_QUERIES query tokens
(prefill), caches longer than MAX_KEYS and anything unusual go to SDPA unchanged.

It is registered with transformers' AttentionInterface under NAME, with SDPA's mask builder, so
the model's own forward runs it (no forked model code) and custom 4D tree masks pass as given.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "specdecode_cpu"
MAX_QUERIES = 32  # more query tokens than this: SDPA (prefill, long verifications)
# more cached positions than this: SDPA, which reads bfloat16 keys/values in place; here they are
# widened to float32 per call, a copy that grows with the context. Still, at 1500 and 3000 cached
# positions the 1.5B target's forward over 5 new tokens was faster here than with SDPA
# (docs/results.md); longer contexts were not measured and
# keep SDPA.
MAX_KEYS = 3072


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, q, d]
    key: torch.Tensor,  # [B, Hkv, L, d]
    value: torch.Tensor,  # [B, Hkv, L, d]
    attention_mask: torch.Tensor | None,  # None, bool (True: attend) or additive; [B|1, 1, q, L]
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # slow import (transformers, ~1 s): the kernels are imported by the command line's parser
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if (
        q_len > MAX_QUERIES
        or kv_len > MAX_KEYS
        or batch != 1
        or query.device.type != "cpu"
        or (dropout and module.training)
        or heads % kv_heads
        or kwargs.get("softcap") is not None
        or kwargs.get("s_aux") is not None  # attention sinks
        or (attention_mask is not None and attention_mask.shape[0] != 1)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    group = heads // kv_heads  # query heads per key/value head: head h reads kv head h // group
    scale = dim**-0.5 if scaling is None else scaling
    q = query.reshape(1, kv_heads, group * q_len, dim).float() * scale  # rows (head in group, t)
    scores = q @ key.float().transpose(-1, -2)  # [1, Hkv, group * q, L]
    scores = scores.view(1, kv_heads, group, q_len, kv_len)
    if attention_mask is not None:
        mask = attention_mask[..., :kv_len]  # as SDPA's and eager's callers slice it
        if mask.shape[1] == 1:  # one mask for all heads: [1, 1, q, L] -> [1, 1, 1, q, L]
            mask = mask[:, :, None]
        else:  # a per-head mask: [1, H, q, L] -> [1, Hkv, group, q, L]
            mask = mask.reshape(1, kv_heads, group, q_len, kv_len)
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    elif q_len > 1:  # causal over the last q_len positions of the cache
        rows = torch.arange(kv_len - q_len, kv_len)[:, None]  # [q, 1]
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > rows, float("-inf"))
    probs = scores.softmax(dim=-1).view(1, kv_heads, group * q_len, kv_len)
    out = probs @ value.float()  # [1, Hkv, group * q, d]
    # [1, H, q, d] -> [1, q, H, d], the layout Hugging Face's attention functions return
    return out.view(1, heads, q_len, dim).transpose(1, 2).to(query.dtype).contiguous(), None


def register() -> str:
    """Make NAME known to transformers (idempotent); returns NAME."""
    # slow imports (transformers' attention and masks, ~3 s): only when a model registers NAME
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_decode_attention(model: Any) -> bool:
    """Switch `model` (a transformers model on SDPA) to NAME; False when it cannot switch."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False  # eager, flash or custom attention: leave the user's choice alone
    if not hasattr(model, "set_attn_implementation"):
        return False
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError):
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME


def restore_attention(model: Any) -> None:
    """Back to SDPA where `use_decode_attention` switched the model."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")
