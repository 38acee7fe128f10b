"""The lean forward (lean.py) for drafts against the model's own forward, and its fused ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.core.cache import KVCache
from specdecode.core.tree import additive_mask
from specdecode.models import lean
from specdecode.models.lean import ENV, LeanCache, draft_cache, unsupported_reason

from conftest import VOCAB, needs_kernel, tiny_gpt2, tiny_llama, tiny_qwen2

LLAMA_FAMILY = {
    "llama": lambda: tiny_llama(seed=1, layers=3),
    "llama-bias-mqa": lambda: tiny_llama(seed=2, attention_bias=True, num_key_value_heads=1),
    "llama3-rope": lambda: tiny_llama(
        seed=3,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: tiny_qwen2(seed=4, layers=3),
}


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", sorted(LLAMA_FAMILY))
def test_matches_the_models_own_forward_through_every_cache_move(arch, monkeypatch):
    monkeypatch.setattr(lean, "CAPACITY", 4)  # the cache must grow (4 -> 16 -> 32)
    model = LLAMA_FAMILY[arch]()
    ours, theirs = LeanCache(model), KVCache(model)
    with torch.inference_mode():
        _close(ours.forward(_ids(11, 0)), theirs.forward(_ids(11, 0)))
        for step, n in enumerate((1, 3, 1, 2)):
            ids = _ids(n, step + 1)
            _close(ours.forward(ids), theirs.forward(ids))
            _close(ours.forward(ids, last_only=True), theirs.forward(ids, last_only=True))
        for cache in (ours, theirs):
            cache.rollback(13)
        ids = _ids(2, 9)
        _close(ours.forward(ids), theirs.forward(ids))
        assert len(ours) == len(theirs) == 15

        # a token tree: root children a, b at depth 1, a's child c at depth 2
        past = len(ours)
        allowed = torch.ones(3, past + 3, dtype=torch.bool)
        allowed[0, past + 1 :] = False  # a sees itself
        allowed[1, past] = allowed[1, past + 2] = False  # b: not a, not c
        allowed[2, past + 1] = False  # c: a and itself
        positions = torch.tensor([past, past, past + 1])
        ids = _ids(3, 10)
        for mask in (additive_mask(allowed, torch.float32), allowed[None, None]):
            _close(
                ours.forward(ids, position_ids=positions, attention_mask=mask),
                theirs.forward(
                    ids,
                    position_ids=positions,
                    attention_mask=additive_mask(allowed, torch.float32),
                ),
            )
            for cache in (ours, theirs):
                cache.rollback(past)
        # accept a -> c: compaction moves them next to the prefix
        ours.forward(ids, position_ids=positions, attention_mask=allowed[None, None])
        theirs.forward(
            ids, position_ids=positions, attention_mask=additive_mask(allowed, torch.float32)
        )
        keep = [*range(past), past, past + 2]
    ours.compact(keep)  # also outside inference mode, on a cache grown inside it
    with torch.inference_mode():
        theirs.compact(keep)
        ids = _ids(2, 11)
        _close(ours.forward(ids), theirs.forward(ids))


def test_long_inputs_run_in_chunks_with_the_same_result(monkeypatch):
    model = tiny_llama(seed=5)
    reference = KVCache(model)
    monkeypatch.setattr(lean, "PREFILL_CHUNK", 4)
    chunked = LeanCache(model)
    ids = _ids(10, 3)
    with torch.inference_mode():
        _close(chunked.forward(ids), reference.forward(ids))
        _close(chunked.forward(ids[:2], last_only=True), reference.forward(ids[:2])[-1:])
    assert len(chunked) == 12


def test_cache_moves_check_their_arguments():
    cache = LeanCache(tiny_llama(seed=6))
    with torch.inference_mode():
        cache.forward(_ids(5, 0))
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(6)
    with pytest.raises(ValueError, match="increasing positions"):
        cache.compact([0, 2, 1])
    with pytest.raises(ValueError, match="increasing positions"):
        cache.compact([0, 5])


def test_unsupported_models_keep_their_own_forward():
    gpt2 = tiny_gpt2()
    assert "gpt2" in unsupported_reason(gpt2)
    assert type(draft_cache(gpt2)) is KVCache
    with pytest.raises(ValueError, match="cannot run this model"):
        LeanCache(gpt2)
    windowed = tiny_llama(seed=7)
    windowed.config.model_type = "mistral"
    windowed.config.sliding_window = 16
    assert unsupported_reason(windowed) == "sliding-window attention"
    training = tiny_llama(seed=8).train()
    assert "training" in unsupported_reason(training)


def test_the_environment_variable_chooses_the_forward(monkeypatch):
    model = tiny_qwen2()
    assert type(draft_cache(model)) is LeanCache
    monkeypatch.setenv(ENV, "hf")
    assert type(draft_cache(model)) is KVCache
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="must be lean or hf"):
        draft_cache(model)


@needs_kernel()
@pytest.mark.parametrize("arch", ["llama-bias-mqa", "qwen2"])
def test_fused_ops_match_the_pytorch_path_in_bfloat16(arch):
    from specdecode.kernels import swap_linears

    model = LLAMA_FAMILY[arch]().to(torch.bfloat16)
    assert LeanCache(model)._fused is None  # plain PyTorch linears: no fused ops either
    swap_linears(model)
    fused, plain = LeanCache(model), LeanCache(model)
    assert fused._fused is not None
    plain._fused = None
    reference = KVCache(model)
    with torch.inference_mode():
        for cache in (fused, plain, reference):
            cache.forward(_ids(20, 0))
        for step, n in enumerate((1, 2, 5, 16)):
            ids = _ids(n, step)
            a, b, c = (cache.forward(ids).float() for cache in (fused, plain, reference))
            # bfloat16 activations: one rounding flipped early moves a logit by a few ulps
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
            torch.testing.assert_close(a, c, rtol=0.05, atol=0.05)
            assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
        past = len(fused)
        allowed = torch.ones(4, past + 4, dtype=torch.bool).tril(diagonal=past)
        allowed[3, past + 1] = False
        mask = additive_mask(allowed, torch.bfloat16)
        ids, positions = _ids(4, 7), torch.tensor([past, past + 1, past + 2, past + 2])
        a, b = (
            cache.forward(ids, position_ids=positions, attention_mask=mask).float()
            for cache in (fused, plain)
        )
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


@needs_kernel()
def test_add_rms_norm_rounds_as_the_models_norm():
    from specdecode.kernels.build import extension

    ext = extension()
    torch.manual_seed(0)
    x, delta = torch.randn(3, 40).bfloat16(), torch.randn(3, 40).bfloat16()
    weight = torch.randn(40).bfloat16()
    total, normed = ext.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)
    h = total.float()
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert (normed.float() - expected.float()).abs().max() <= 2**-7 * expected.abs().max()
    same, _ = ext.add_rms_norm(x, None, weight, 1e-6)
    assert same.data_ptr() == x.data_ptr()
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.add_rms_norm(x.float(), None, weight, 1e-6)
    with pytest.raises(RuntimeError, match="shape"):
        ext.add_rms_norm(x, delta[:2], weight, 1e-6)


@needs_kernel()
def test_add_rms_norm_f32_keeps_the_sum_in_float32_and_rounds_once():
    from specdecode.kernels.build import extension

    ext = extension()
    torch.manual_seed(0)
    x, delta = torch.randn(3, 40), torch.randn(3, 40).bfloat16()
    weight = torch.randn(40).bfloat16()
    total, normed = ext.add_rms_norm_f32(x, delta, weight, 1e-6)
    assert total.dtype == torch.float32 and normed.dtype == torch.bfloat16
    assert torch.equal(total, x + delta.float())
    h = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (weight.float() * h).bfloat16()  # one rounding, at the end
    assert (normed.float() - expected.float()).abs().max() <= 2**-8 * expected.abs().max()
    same, _ = ext.add_rms_norm_f32(x, None, weight, 1e-6)
    assert same.data_ptr() == x.data_ptr()
    with pytest.raises(RuntimeError, match="float32"):
        ext.add_rms_norm_f32(x.bfloat16(), None, weight, 1e-6)
    with pytest.raises(RuntimeError, match="shape"):
        ext.add_rms_norm_f32(x, delta[:2], weight, 1e-6)


@needs_kernel()
def test_rope_attention_refuses_bad_shapes():
    from specdecode.kernels.build import extension

    ext = extension()
    q, k = torch.zeros(2, 4 * 8).bfloat16(), torch.zeros(2, 2 * 8).bfloat16()
    cos, sin = torch.ones(2, 8), torch.zeros(2, 8)
    cache = torch.zeros(2, 2, 4, 8)
    ext.rope_attention(q, k, k, cos, sin, cache[0], cache[1], 2, None, 0.5)  # fits exactly
    with pytest.raises(RuntimeError, match="no room"):
        ext.rope_attention(q, k, k, cos, sin, cache[0], cache[1], 3, None, 0.5)
    with pytest.raises(RuntimeError, match="mask"):
        ext.rope_attention(q, k, k, cos, sin, cache[0], cache[1], 0, torch.zeros(2, 3), 0.5)
    with pytest.raises(RuntimeError, match="float32"):
        ext.rope_attention(q, k, k, cos.double(), sin, cache[0], cache[1], 0, None, 0.5)


def test_memory_estimates_count_the_lean_cache_as_it_is_held():
    from specdecode.bench.memory import estimate_bytes, kv_bytes_per_token, weights_bytes
    from specdecode.models.lean import CAPACITY, capacity_for

    assert capacity_for(10) == CAPACITY
    assert capacity_for(CAPACITY + 1) == 2 * CAPACITY
    assert capacity_for(5 * CAPACITY) == 8 * CAPACITY
    target, draft = tiny_llama(seed=9), tiny_qwen2(seed=10)

    def cache_bytes(model, n_tokens):  # float32 keys and values of every layer, as allocated
        return kv_bytes_per_token(model, element=4) * capacity_for(n_tokens)

    cache = LeanCache(draft)
    with torch.inference_mode():
        cache.forward(_ids(CAPACITY + 3, 0), last_only=True)
    assert cache.kv.numel() * cache.kv.element_size() == cache_bytes(draft, CAPACITY + 3)
    models = weights_bytes(target) + weights_bytes(draft)
    own = estimate_bytes(target, draft, 300)
    lean_held = estimate_bytes(target, draft, 300, lean_draft=True)
    target_cache = kv_bytes_per_token(target) * 300
    assert own == models + target_cache + kv_bytes_per_token(draft) * 300
    assert lean_held == models + target_cache + cache_bytes(draft, 300)
    both_lean = estimate_bytes(target, draft, 300, lean_draft=True, lean_target=True)
    assert both_lean == models + cache_bytes(target, 300) + cache_bytes(draft, 300)


@needs_kernel()
def test_silu_mul_rounds_as_pytorch():
    from specdecode.kernels.build import extension

    ext = extension()
    # every bfloat16 value in [-80, 80] as a gate (below about -87 the fused SiLU's e^x flushes
    # to zero where PyTorch keeps numbers under 1e-36); lengths with and without a tail
    bits = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = bits[bits.float().abs() <= 80]
    torch.manual_seed(0)
    for n in (len(gates), 1, 7, 8, 9, 23):
        gate = gates[torch.randperm(len(gates))[:n]].reshape(1, n).contiguous()
        up = (torch.randn(1, n) * 3).bfloat16()
        assert torch.equal(ext.silu_mul(gate, up), F.silu(gate) * up)
    special = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -100.0]])
    gate = special.bfloat16()
    expected = F.silu(gate)  # nan, inf, nan (-inf / inf), 0, -0, -0
    out = ext.silu_mul(gate, torch.ones_like(gate))
    numbers = ~expected.isnan()
    assert torch.equal(out.isnan(), ~numbers)
    assert torch.equal(out[numbers], expected[numbers])
    assert torch.equal(out[numbers].signbit(), expected[numbers].signbit())  # -0 stays -0
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.silu_mul(gate.float(), gate.float())
    with pytest.raises(RuntimeError, match="shape"):
        ext.silu_mul(gate, gate[:, :2].contiguous())


def _attention_reference(q, keys, values, cos, sin, past, mask, scale):
    """rope_attention's output computed in float64 from the cache it wrote: [n, H * d]."""
    n, d = q.shape[0], keys.shape[-1]
    kv_heads, heads = keys.shape[0], q.shape[1] // d
    half = d // 2
    x = q.double().view(n, heads, d)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    x = (x * cos.double()[:, None] + rotated * sin.double()[:, None]) * scale
    length = past + n
    k, v = keys[:, :length].double(), values[:, :length].double()
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for t in range(n):
        for h in range(heads):
            scores = k[h // (heads // kv_heads)] @ x[t, h]  # [L]
            if mask is None:
                scores[past + t + 1 :] = -torch.inf
            else:
                scores = scores + mask[t].double()
            out[t, h] = scores.softmax(-1) @ v[h // (heads // kv_heads)]
    return out.view(n, heads * d)


@needs_kernel()
@pytest.mark.parametrize(
    "heads,kv_heads,d", [(12, 2, 128), (14, 2, 64), (12, 1, 40), (4, 4, 16), (18, 2, 8)]
)
def test_rope_attention_is_exact_per_row_whatever_the_call(heads, kv_heads, d):
    """Each (token, head)'s output is the float64 attention within bfloat16 rounding, and the
    same bits whether its token comes alone or with others, and with any number of heads per
    key/value head (the kernel reads a key once for up to 8 queries)."""
    from specdecode.kernels.build import extension

    ext = extension()
    gen = torch.Generator().manual_seed(heads * d)
    past, n, capacity = 37, 5, 64
    q = torch.randn(n, heads * d, generator=gen).bfloat16()
    k = torch.randn(n, kv_heads * d, generator=gen).bfloat16()
    v = torch.randn(n, kv_heads * d, generator=gen).bfloat16()
    angles = torch.rand(n, d // 2, generator=gen) * 6
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    start = torch.randn(2, kv_heads, capacity, d, generator=gen)
    for mask in (None, torch.randn(n, past + n, generator=gen)):
        if mask is not None:  # a tree's: some keys hidden, none past the row's own token
            mask[:, 5::3] = -torch.inf
            mask.masked_fill_(torch.ones(n, past + n, dtype=torch.bool).triu(past + 1), -torch.inf)
        cache = start.clone()
        together = ext.rope_attention(q, k, v, cos, sin, cache[0], cache[1], past, mask, 0.3)
        expected = _attention_reference(q, cache[0], cache[1], cos, sin, past, mask, 0.3)
        assert (together.double() - expected).abs().max() <= 2**-8 * expected.abs().max()
        alone = start.clone()
        for t in range(n):  # the same tokens one at a time, over the cache the call before wrote
            row = ext.rope_attention(
                q[t : t + 1],
                k[t : t + 1],
                v[t : t + 1],
                cos[t : t + 1],
                sin[t : t + 1],
                alone[0],
                alone[1],
                past + t,
                None if mask is None else mask[t : t + 1, : past + t + 1].contiguous(),
                0.3,
            )
            assert torch.equal(row.view(torch.int16), together[t : t + 1].view(torch.int16))
        assert torch.equal(alone, cache)
