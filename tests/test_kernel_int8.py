"""int8 drafts: the int8 kernel (on 16-row panels) computes x @ (q * scale)^T up to one bfloat16
rounding, batch invariant; `quantize_linears` keeps the state dict; `MODEL:int8` drafts stay
lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode import SpeculativeDecoder
from specdecode.drafters import resolve_draft
from specdecode.kernels import quantize_int8, quantize_linears, restore_linears
from specdecode.kernels.build import extension, use_int8_avx512
from specdecode.kernels.panels import pack_panels
from specdecode.kernels.quantize import int8_weights, pack_int8_panels, quant_name

from conftest import linear_case, needs_kernel, noisy_copy, tiny_llama, tiny_qwen2

pytestmark = needs_kernel()


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]  # [N, K] float32


def int8_linear(x, q, scale, b):
    """The kernel call a quantized layer makes: q [N, K] packed into panels first."""
    return extension().linear_int8_packed(x, pack_int8_panels(q), q.shape[0], scale, b)


def test_quantize_int8_round_trip():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 70, generator=gen).bfloat16()
    w[5] = 0  # an all-zero row keeps a usable scale
    q, scale = quantize_int8(w, rows=64)  # several chunks and a partial last one
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (300,)
    assert q.abs().max() <= 127 and scale[5] == 1 and not q[5].any()
    # every weight within half a step of its row's scale; each row's largest weight is exact
    error = (_dequantized(q, scale) - w.float()).abs()
    assert (error <= scale[:, None] / 2 + 1e-6).all()
    assert (q.abs().amax(dim=1)[torch.arange(300) != 5] == 127).all()


@pytest.mark.parametrize("k", [5, 16, 37, 256])
@pytest.mark.parametrize("n", [1, 8, 13, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_matches_the_dequantized_linear(k, n, bias):
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 12):
        x, w, b = linear_case(m, k, n, seed=k * 100 + n + m, bias=bias)
        q, scale = quantize_int8(w)
        out = int8_linear(x, q, scale, b)
        reference = F.linear(x.float(), _dequantized(q, scale), None if b is None else b.float())
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("m", [2, 3, 4, 5, 6, 7, 8, 13])
def test_int8_kernel_is_batch_invariant_bit_for_bit(m):
    x, w, b = linear_case(m, 897, 72, seed=m, bias=True)  # an odd K: a k loop tail
    q, scale = quantize_int8(w)
    together = int8_linear(x, q, scale, b)
    for i in range(m):
        assert torch.equal(together[i], int8_linear(x[i : i + 1], q, scale, b)[0])


def test_int8_tile_on_avx512_is_bit_identical_to_avx2():
    # both tiles run the same float32 FMA chain over k per output
    if not use_int8_avx512(True):
        pytest.skip("this CPU has no AVX-512")
    x, w, b = linear_case(17, 897, 72, seed=3, bias=True)  # an odd K: a k loop tail
    q, scale = quantize_int8(w)
    try:
        for m in range(1, 18):  # every tile shape, and blocks of them
            avx512 = int8_linear(x[:m], q, scale, b)
            use_int8_avx512(False)
            avx2 = int8_linear(x[:m], q, scale, b)
            use_int8_avx512(True)
            assert torch.equal(avx512, avx2), m
    finally:
        use_int8_avx512(True)


def test_int8_kernel_refuses_bad_arguments():
    x, w, _ = linear_case(2, 32, 8, seed=0, bias=False)
    q, scale = quantize_int8(w)
    panels = pack_int8_panels(q)
    with pytest.raises(RuntimeError, match="int8 CPU panels"):
        extension().linear_int8_packed(x, pack_panels(w), 8, scale, None)
    with pytest.raises(RuntimeError, match="scale"):
        extension().linear_int8_packed(x, panels, 8, scale[:4], None)
    with pytest.raises(RuntimeError, match="ceil"):  # x's K does not match the panels'
        extension().linear_int8_packed(x[:, :16].contiguous(), panels, 8, scale, None)


def test_quantize_linears_keeps_the_state_dict_and_restores():
    model = tiny_qwen2(seed=3).to(torch.bfloat16)  # q/k/v projections carry biases
    state = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    with torch.no_grad():
        plain = model(ids).logits
        assert quantize_linears(model) == linears
        assert quantize_linears(model) == linears  # idempotent
        int8 = model(ids).logits
        float_inputs = model.float()  # other dtypes: the same int8 weights through PyTorch
        assert float_inputs(ids).logits.shape == int8.shape
        model.to(torch.bfloat16)
        assert restore_linears(model) == linears
        again = model(ids).logits
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], t) for name, t in model.state_dict().items())
    assert not any("_specdecode" in name for name, _ in model.named_buffers())
    assert not torch.equal(int8, plain)  # the weights were quantized...
    torch.testing.assert_close(int8.float(), plain.float(), rtol=0.1, atol=0.1)  # ...finely
    assert torch.equal(again, plain)


def test_int8_layer_falls_back_for_float32_and_autograd():
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16)
    quantize_linears(layer)
    q, scale = int8_weights(layer)
    x = torch.randn(3, 32)
    with torch.no_grad():
        kernel = layer(x.bfloat16()).float()
    expected = F.linear(x, _dequantized(q, scale), layer.bias.float())
    torch.testing.assert_close(kernel, expected, rtol=2**-7, atol=1e-2)
    x_grad = x.bfloat16().requires_grad_()
    layer(x_grad).float().sum().backward()  # no backward in the kernel: PyTorch runs it
    assert x_grad.grad is not None


def test_int8_draft_spec(tmp_path):
    folder = tmp_path / "tiny"
    tiny_llama(seed=0).to(torch.bfloat16).save_pretrained(folder)
    draft = resolve_draft(f"{folder}:int8", None, dtype="bfloat16", device="cpu")
    assert draft.kernel == quant_name(8) and draft.name.endswith(":int8")
    assert any(hasattr(m, "_specdecode_qweight") for m in draft.model.modules())
    plain = resolve_draft(str(folder), None, dtype="bfloat16", device="cpu")
    assert not any(hasattr(m, "_specdecode_qweight") for m in plain.model.modules())
    with pytest.raises(ValueError, match="the dtype is float32: use --dtype bfloat16"):
        resolve_draft(f"{folder}:int8", None, dtype="float32", device="cpu")
    for spec in ("ngram:int8", "ngram:1-3:int8", "early-exit:2:int8", ":int8"):
        with pytest.raises(ValueError, match="quantizes a draft model"):
            resolve_draft(spec, None)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_decoding_with_an_int8_draft_is_lossless(factory, seed):
    # the draft's weights change, never the target's: float32 target, exact greedy identity
    target = factory(seed=seed)
    draft = noisy_copy(target, 0.05, seed=seed).to(torch.bfloat16)
    quantize_linears(draft)
    prompt = [1 + seed, 2, 3]
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
    # a fixed k: acceptance at the k named, not at what this machine's timings would choose
    for kwargs in ({"k": 1}, {"k": 4}, {"tree": "static:3,2,1"}, {"tree": "dynamic:6"}):
        result = SpeculativeDecoder(target, draft, k_policy="fixed", **kwargs).generate(
            prompt, max_new_tokens=40
        )
        assert result.token_ids == expected, kwargs
        assert result.stats.acceptance_rate > 0.3, kwargs  # int8 keeps the draft useful
