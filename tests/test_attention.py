"""The decode attention (`specdecode.kernels.attention`): SDPA's results for few query tokens,
grouped-query heads without copies, every mask form; lossless speculative decoding on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode import SpeculativeDecoder
from specdecode.kernels.attention import (
    MAX_KEYS,
    MAX_QUERIES,
    NAME,
    attention_forward,
    restore_attention,
    use_decode_attention,
)

from conftest import noisy_copy, tiny_llama, tiny_qwen2


class _Module(torch.nn.Module):
    def __init__(self, group: int) -> None:
        super().__init__()
        self.num_key_value_groups = group
        self.eval()


def _reference(query, key, value, mask, scale):
    """Plain SDPA on repeated key/value heads; mask: None (causal, bottom-right) or 4D."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    q_len, kv_len = query.shape[2], key.shape[2]
    if mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)  # [B, q, H, d]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("q_len", [1, 2, 5, 9])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "per-head"])
def test_matches_sdpa(heads, kv_heads, q_len, mask_kind):
    gen = torch.Generator().manual_seed(heads * 100 + q_len)
    kv_len, dim = 23, 16
    query = torch.randn(1, heads, q_len, dim, generator=gen)
    key = torch.randn(1, kv_heads, kv_len, dim, generator=gen)
    value = torch.randn(1, kv_heads, kv_len, dim, generator=gen)
    allowed = torch.rand(1, 1, q_len, kv_len + 3, generator=gen) > 0.4  # wider: sliced to L
    allowed[..., 0] = True  # every query sees at least one key
    mask = {
        "none": None,
        "bool": allowed,
        "additive": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float).min),
        "per-head": allowed.expand(1, heads, q_len, kv_len + 3),
    }[mask_kind]
    out, weights = attention_forward(_Module(heads // kv_heads), query, key, value, mask, 0.0, 0.3)
    expected = _reference(query, key, value, None if mask is None else mask[..., :kv_len], 0.3)
    assert weights is None and out.shape == (1, q_len, heads, dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_come_back_bfloat16():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 8, generator=gen).bfloat16()
    key, value = (torch.randn(1, 2, 10, 8, generator=gen).bfloat16() for _ in range(2))
    out, _ = attention_forward(_Module(2), query, key, value, None)
    expected = _reference(query.float(), key.float(), value.float(), None, 8**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=2**-7, atol=2**-7)


def test_prefill_sized_calls_go_to_sdpa(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    real = sdpa.sdpa_attention_forward
    monkeypatch.setattr(
        sdpa, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    query = torch.randn(1, 2, MAX_QUERIES + 1, 8)
    key = value = torch.randn(1, 2, MAX_QUERIES + 1, 8)
    attention_forward(_Module(1), query, key, value, None, is_causal=True)
    assert calls == [1]
    attention_forward(_Module(1), query[:, :, :4], key, value, None)
    assert calls == [1]
    long_cache = torch.randn(1, 2, MAX_KEYS + 1, 8)  # long contexts too: no float32 cache copy
    attention_forward(_Module(1), query[:, :, :1], long_cache, long_cache, None)
    assert calls == [1, 1]


def test_switch_and_restore():
    model = tiny_llama(seed=0)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        plain = model(ids).logits
        assert use_decode_attention(model)
        assert model.config._attn_implementation == NAME
        ours = model(ids).logits  # 8 query tokens: ours, causal without a cache
        restore_attention(model)
        assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)
    eager = tiny_llama(seed=0)
    eager.set_attn_implementation("eager")
    assert not use_decode_attention(eager)  # the user's choice stays
    assert eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_decoding_on_it_is_exact(factory, seed):
    # invariant 1 in float32: chains and trees (custom 4D masks) give the target's own greedy,
    # and the draft proposes what it proposed on SDPA (the same acceptance, step for step)
    target = factory(seed=seed)
    draft = noisy_copy(target, 0.05, seed=seed)
    prompt = [1 + seed, 2, 3]
    settings = ({"k": 1}, {"k": 4}, {"tree": "static:3,2,1"}, {"tree": "dynamic:6"})
    settings = tuple({**kw, "k_policy": "fixed"} for kw in settings)  # step for step
    on_sdpa = [SpeculativeDecoder(target, draft, **kw).generate(prompt, 40) for kw in settings]
    assert use_decode_attention(target) and use_decode_attention(draft)
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
    for kwargs, sdpa in zip(settings, on_sdpa, strict=True):
        result = SpeculativeDecoder(target, draft, **kwargs).generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected == sdpa.token_ids, kwargs
        assert result.stats.accepted_at == sdpa.stats.accepted_at, kwargs
        assert result.stats.accepted > 0, kwargs
