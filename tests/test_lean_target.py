"""The target on the lean forward (lean.target_cache): chosen only where its rows are batch
invariant, each verified row bit for bit a one-token forward, and speculation over it lossless."""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.cache import KVCache
from specdecode.core.tree import additive_mask
from specdecode.kernels import swap_linears
from specdecode.kernels.build import bf16_amx_on
from specdecode.models.lean import TARGET_ENV, VERIFY_TOKENS, LeanCache, LeanStore, target_cache

from conftest import VOCAB, WIDE, needs_kernel, noisy_copy, on_kernel, tiny_llama, tiny_qwen2

pytestmark = needs_kernel()


def _target(arch: str, bits: int | None, seed: int = 0):
    if arch == "qwen2":  # biases on q, k, v
        model = tiny_qwen2(seed=seed, layers=3)
    else:
        model = tiny_llama(seed=seed, layers=3, **WIDE)
    return on_kernel(model, bits)


def _float32_twin(quantized: torch.nn.Module, fresh: torch.nn.Module) -> torch.nn.Module:
    """`fresh` (the same architecture, float32) with every linear's weight the quantized
    model's as it computes with it: the 4-bit model's arithmetic without rounding."""
    from specdecode.kernels.quantize import is_quantized, quantized_weights

    modules = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in fresh.named_modules():
            if isinstance(module, torch.nn.Linear) and is_quantized(modules[name]):
                module.weight.copy_(quantized_weights(modules[name]))
    return fresh.float().eval()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_the_target_runs_lean_only_on_the_kernels_fused_path(monkeypatch):
    model = tiny_llama(seed=0, layers=2, **WIDE)
    assert isinstance(target_cache(model), KVCache)  # float32: Hugging Face's forward
    bf16 = model.to(torch.bfloat16)
    assert isinstance(target_cache(bf16), KVCache)  # plain PyTorch linears: no fused path
    swap_linears(bf16)
    cache = target_cache(bf16)
    assert isinstance(cache, LeanCache) and cache.fused_tokens == VERIFY_TOKENS
    monkeypatch.setenv(TARGET_ENV, "hf")
    assert isinstance(target_cache(bf16), KVCache)
    monkeypatch.setenv(TARGET_ENV, "fast")
    with pytest.raises(ValueError, match="SPECDECODE_TARGET_FORWARD must be lean or hf"):
        target_cache(bf16)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_a_quantized_target_keeps_float32_hidden_states(bits):
    model = _target("llama", bits)
    cache = target_cache(model)
    wide = bits is not None  # a bfloat16 target rounds as Hugging Face's forward does
    assert cache.residual == (torch.float32 if wide else torch.bfloat16)
    store = LeanStore(model, rows=2, max_len=64)
    assert store.open_row().residual == cache.residual  # the batched server's rows too
    ids = _ids(30, 4)
    with torch.inference_mode():
        fused = target_cache(model).forward(ids)  # 30 rows: the fused path
        prefill = LeanCache(model, fused_tokens=0, residual=cache.residual).forward(ids)
        narrow = LeanCache(model, fused_tokens=VERIFY_TOKENS).forward(ids)
    assert fused.dtype == prefill.dtype == torch.bfloat16
    # the fused and PyTorch paths compute the same float32 stream (up to summation order)
    torch.testing.assert_close(fused.float(), prefill.float(), rtol=0.02, atol=0.02)
    assert torch.equal(fused, narrow) != wide  # float32 hidden states change the rounding


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("n", [3, 13, 40])  # 40: past the drafts' fused limit
def test_each_verified_row_is_a_one_token_forward(arch, bits, n):
    model = _target(arch, bits)
    with torch.inference_mode():
        prefilled = target_cache(model)
        prefilled.forward(_ids(21, 0), last_only=True)  # a prompt's prefill, shared by both
        ids = _ids(n, 1)
        together = prefilled.copy().forward(ids)  # [n, V]: one verification pass
        alone = prefilled.copy()
        rows = torch.cat([alone.forward(ids[i : i + 1]) for i in range(n)])  # n one-token passes
    assert torch.equal(together, rows)


@pytest.mark.parametrize("bits", [None, 4])
def test_each_tree_node_is_a_one_token_forward_along_its_path(bits):
    model = _target("llama", bits)
    # root r (the last committed token) with children a, b; a's child c; b's child d
    parents = [-1, 0, 0, 1, 2]
    ids = _ids(5, 2)
    with torch.inference_mode():
        prefilled = target_cache(model)
        prefilled.forward(_ids(17, 3), last_only=True)
        past = len(prefilled)
        allowed = torch.zeros(5, past + 5, dtype=torch.bool)
        allowed[:, :past] = True
        for node, parent in enumerate(parents):
            allowed[node, past + node] = True
            while parent >= 0:
                allowed[node, past + parent] = True
                parent = parents[parent]
        depth = allowed[:, past:].sum(1) - 1
        tree = prefilled.copy().forward(
            ids,
            position_ids=past + depth,
            attention_mask=additive_mask(allowed, torch.float32)[None, None],
        )  # [5, V]
        for node in range(5):
            path = [i for i in range(5) if allowed[node, past + i]]  # root .. node, in order
            alone = prefilled.copy()
            for i in path:
                last = alone.forward(ids[i : i + 1])
            assert torch.equal(tree[node], last[0]), node


@pytest.mark.parametrize("bits", [None, 4])
def test_speculation_over_a_lean_target_equals_the_target_alone(bits):
    target = _target("llama", bits, seed=5)
    draft = on_kernel(noisy_copy(tiny_llama(seed=5, layers=3, **WIDE), 0.05, seed=6), 4)
    assert isinstance(target_cache(target), LeanCache)
    prompts = [[1, 2, 3], [7] * 20, [11]]
    ar = SpeculativeDecoder(target)
    for prompt in prompts:
        expected = ar.generate(prompt, max_new_tokens=40).token_ids
        for options in ({"k": 1}, {"k": 4}, {"k": 9}, {"tree": "dynamic:6,4,2"}):
            got = SpeculativeDecoder(target, draft, k_policy="fixed", **options).generate(
                prompt, max_new_tokens=40
            )
            assert got.token_ids == expected, (prompt, options)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_the_native_layer_loop_is_the_python_loop_bit_for_bit(arch, bits, monkeypatch):
    import specdecode.models.lean as lean

    model = _target(arch, bits, seed=3)
    # a tree of 4 nodes after 12 cached positions (parents -1, 0, 0, 1): masked keys and
    # position ids of its own
    allowed = torch.ones(4, 12 + 4, dtype=torch.bool)
    allowed[:, 12:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]) > 0
    depth = torch.tensor([0, 1, 1, 2]) + 12
    runs = []
    for native in (True, False):
        monkeypatch.setattr(lean, "NATIVE_LOOP", native)
        with torch.inference_mode():
            cache = target_cache(model)
            assert cache._native is not None and len(cache._native) == 3  # every linear a kernel
            out = [cache.forward(_ids(12, 5)), cache.forward(_ids(1, 6)), cache.forward(_ids(5, 7))]
            cache.rollback(12)
            out.append(
                cache.forward(
                    _ids(4, 8),
                    position_ids=depth,
                    attention_mask=additive_mask(allowed, torch.float32)[None, None],
                )
            )
        runs.append((out, cache.kv[:, :, :, : len(cache)].clone()))
    (native_out, native_kv), (python_out, python_kv) = runs
    assert all(torch.equal(a, b) for a, b in zip(native_out, python_out, strict=True))
    assert torch.equal(native_kv, python_kv)  # the keys and values written, too


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("bits", [None, 4])
def test_the_native_loop_over_many_sequences_is_the_python_loop_bit_for_bit(
    arch, bits, monkeypatch
):
    import specdecode.models.lean as lean

    model = _target(arch, bits, seed=5)
    # three sequences of different pasts: one new token, a chain of 5, a tree of 4 (masked keys
    # and position ids of its own), as a batch's step runs them in one forward
    allowed = torch.ones(4, 9 + 4, dtype=torch.bool)
    allowed[:, 9:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]) > 0
    tree_mask = additive_mask(allowed, torch.float32)[None, None]
    runs = []
    for native in (True, False):
        monkeypatch.setattr(lean, "NATIVE_LOOP", native)
        with torch.inference_mode():
            caches = [target_cache(model) for _ in range(3)]
            assert caches[0]._native is not None
            for i, (cache, n) in enumerate(zip(caches, [14, 3, 9], strict=True)):
                cache.forward(_ids(n, 20 + i))
            out = LeanCache.forward_many(
                caches,
                [_ids(1, 30), _ids(5, 31), _ids(4, 32)],
                positions=[None, None, torch.tensor([0, 1, 1, 2]) + 9],
                masks=[None, None, tree_mask],
            )
        runs.append((out, [c.kv[:, :, :, : len(c)].clone() for c in caches]))
    (native_out, native_kv), (python_out, python_kv) = runs
    assert [o.shape[0] for o in native_out] == [1, 5, 4]
    assert all(torch.equal(a, b) for a, b in zip(native_out, python_out, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(native_kv, python_kv, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_long_prefill_attends_causally_at_once_and_in_parts(arch, monkeypatch):
    # past VERIFY_TOKENS rows a prefill's attention is PyTorch's fused one: causal from the
    # first position, and over a cached prefix (a prompt's later part, `PREFILL_CHUNK`) with
    # the prefix visible to every new row; both equal Hugging Face's float32 forward
    model = (tiny_llama(seed=3, layers=2, **WIDE) if arch == "llama" else tiny_qwen2(seed=3)).eval()
    n = VERIFY_TOKENS + 40
    ids = _ids(2 * n, 5)
    pasts = []
    attend = LeanCache._attend_prefill

    def spy(self, q, kv, past):
        pasts.append(past)
        return attend(self, q, kv, past)

    monkeypatch.setattr(LeanCache, "_attend_prefill", spy)
    with torch.inference_mode():
        want = model(input_ids=ids[None]).logits[0]  # [2n, V]
        at_once = LeanCache(model).forward(ids)
        parts = LeanCache(model)
        first, second = parts.forward(ids[:n]), parts.forward(ids[n:])
    assert at_once.dtype == torch.float32
    torch.testing.assert_close(at_once, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([first, second]), want, rtol=1e-4, atol=1e-4)
    assert pasts == [0, 0, 0, 0, n, n]  # per layer: at once, then the two parts


@pytest.mark.parametrize("bits", [None, 4])
def test_a_long_prefill_may_take_pytorchs_product_and_the_output_stays_the_targets(
    bits, monkeypatch
):
    from specdecode.kernels.panels import PREFILL_ENV

    model = _target("llama", bits, seed=7)
    prompt = _ids(VERIFY_TOKENS + 22, 9)
    with torch.inference_mode():
        on_panels = target_cache(model)
        want = on_panels.forward(prompt)  # [150, V]: the fused path, on the panels
        monkeypatch.setenv(PREFILL_ENV, "torch")
        cache = target_cache(model)
        got = cache.forward(prompt)
    if bits is not None and not bf16_amx_on():
        # quantized: no bfloat16 weight to hand PyTorch, and no AMX tiles: the tiles stay
        assert cache._prefill is None and torch.equal(got, want)
        return
    assert cache._prefill is not None and cache.fused_len == 0  # the PyTorch path
    if bits is None:
        torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.02)
    else:  # 4-bit on AMX: the panels unpacked to bfloat16, the activations not quantized, so
        # at least as close to the 4-bit weights' float32 arithmetic as the fused path's 8-bit
        # activations are
        exact = _float32_twin(model, tiny_llama(seed=7, layers=3, **WIDE))
        with torch.inference_mode():
            reference = exact(input_ids=prompt[None]).logits[0]  # [150, V]
        assert (got.float() - reference).abs().mean() <= (want.float() - reference).abs().mean()
    # its keys and values are not the fused path's bits: no prefix of a long prompt is kept
    assert cache.reusable_prefix(prompt.tolist()) == 0
    short = LeanCache(model, VERIFY_TOKENS)
    with torch.inference_mode():
        short.forward(prompt[:40])  # few rows: still the fused path
    assert short.fused_len == 40 and short.reusable_prefix(prompt[:40].tolist()) == 40
    # both the target alone and speculation prefill the prompt this way: the same output
    draft = on_kernel(noisy_copy(tiny_llama(seed=7, layers=3, **WIDE), 0.05, seed=8), 4)
    expected = SpeculativeDecoder(model).generate(prompt.tolist(), max_new_tokens=30).token_ids
    for options in ({"k": 4}, {"tree": "dynamic:6,4,2"}):
        got_ids = SpeculativeDecoder(model, draft, k_policy="fixed", **options).generate(
            prompt.tolist(), max_new_tokens=30
        )
        assert got_ids.token_ids == expected, options
    monkeypatch.setenv(PREFILL_ENV, "fast")
    with pytest.raises(ValueError, match="SPECDECODE_PREFILL_LINEARS must be one of"):
        target_cache(model)
