"""4-bit drafts: the int4 kernel computes x @ (q * scale + min)^T (scale and min coded on 8 bits
under float16 steps) on activations quantized to 8 bits per token and group of 32 k (the min term on the exact sum of x), up to one bfloat16
rounding, batch invariant; `quantize_linears(bits=4)` keeps the state dict and a tied output layer on
int8; `MODEL:int4` drafts stay lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode import SpeculativeDecoder
from specdecode.drafters import resolve_draft
from specdecode.kernels import quantize_linears, restore_linears
from specdecode.kernels.build import extension, int4_vnni_on, use_int4_vnni
from specdecode.kernels.quantize import (
    dequantize_int4,
    int4_scale_min,
    int4_shift,
    int4_weights,
    pack_int4_panels,
    quantize_int4,
)

from conftest import linear_case, needs_kernel, noisy_copy, tiny_llama, tiny_qwen2

pytestmark = needs_kernel()


def _reference(x, codes, b):
    """What the kernel computes, in float64: per group (scale dx) (xq . q) + min (sum of x)."""
    m, k = x.shape
    q = codes[0]
    scale, low = int4_scale_min(codes)
    groups = x.double().reshape(m, k // 32, 32)  # [M, G, 32]
    amax = groups.abs().amax(-1)  # [M, G]
    # 127 / amax as the kernel rounds it (a tensor division: `127 / t` multiplies by 1 / t)
    inv = torch.full_like(amax, 127).float() / amax.float()
    inv = torch.where(amax > 0, inv, torch.zeros_like(inv))
    xq = torch.round(groups.float() * inv[..., None]).double()  # -127..127
    dots = torch.einsum("mgi,ngi->mng", xq, q.double().reshape(-1, k // 32, 32))  # [M, N, G]
    out = (dots * scale.double() * (amax / 127)[:, None]).sum(-1)
    out += groups.sum(-1) @ low.double().T  # [M, G] @ [G, N]
    return out if b is None else out + b.double()


def _per_group_steps(codes):
    """The same weights with one step per group (shift 0, as a Q4_0 / Q4_1 file's): sc, ml the
    codes as they are, d and dl repeated per group."""
    q, sc, ml, d, dl = codes
    g = sc.shape[1]
    return q, sc, ml, *(t.repeat_interleave(8, 1)[:, :g].contiguous() for t in (d, dl))


def test_activation_quantization_stays_close_to_the_float_product():
    x, w, _ = linear_case(4, 896, 64, seed=7, bias=False)
    codes = quantize_int4(w)
    exact = F.linear(x.double(), dequantize_int4(codes).double())
    error = (int4_linear(x, codes, None).double() - exact).norm() / exact.norm()
    assert error < 0.01  # 8-bit activations per 32: under 1% of the product's norm


def int4_linear(x, codes, b):
    """The kernel call a 4-bit layer makes, on the codes packed into panels first."""
    panels, packed, steps = pack_int4_panels(*codes)
    shift = int4_shift(packed.shape[1], steps.shape[1])
    return extension().linear_int4_packed(x, panels, codes[0].shape[0], packed, steps, shift, b)


def test_quantize_int4_round_trip_and_its_codes():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 288, generator=gen)  # 9 groups: a block of 8 and a short one
    w[3, :32] = 0.5  # a constant group: its min, step code 0
    q, sc, ml, d, dl = codes = quantize_int4(w)
    assert q.dtype == sc.dtype == torch.uint8 and ml.dtype == torch.int8
    assert q.shape == w.shape and int(q.max()) <= 15
    assert sc.shape == ml.shape == (40, 9) and d.shape == dl.shape == (40, 2)
    assert d.dtype == dl.dtype == torch.float16  # 2 bytes each per 256 weights
    weights = dequantize_int4(codes)
    assert sc[3, 0] == 0 and (weights[3, :32] - 0.5).abs().max() <= float(dl[3, 0])
    # within half a step, plus the coding of the min (half of dl) and of the step (15 d / 2)
    _, _, _, d_group, dl_group = _per_group_steps(codes)
    bound = int4_scale_min(codes)[0] / 2 + dl_group.float() / 2 + 7.5 * d_group.float()
    assert ((weights - w).abs() <= bound.repeat_interleave(32, dim=1) + 1e-6).all()
    # about as close as float16 steps per group: RMS error within 1% of that
    groups = w.reshape(40, 9, 32)
    lo = groups.amin(-1).half().float()
    st = ((groups.amax(-1) - lo) / 15).half().float()
    st = torch.where(st > 0, st, torch.ones_like(st))
    per_group = torch.round((groups - lo[..., None]) / st[..., None]).clamp(0, 15)
    per_group = (per_group * st[..., None] + lo[..., None]).reshape(40, 288)
    rms = lambda t: float((t - w).pow(2).mean().sqrt())  # noqa: E731
    assert rms(dequantize_int4(codes)) <= 1.01 * rms(per_group)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="float16's range"):
        quantize_int4(torch.full((1, 32), 1e6))
    # rows are independent: done a few at a time (a large output layer), the codes are the same
    for got, whole in zip(quantize_int4(w, rows=7), codes, strict=True):
        assert torch.equal(got, whole)


def test_a_freed_weights_pages_go_back_and_the_layer_computes_the_same():
    # 1 MiB of bfloat16 weights: past drop_pages' 16 pages; nothing reads them once freed
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 512, bias=False).to(torch.bfloat16) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(3, 1024).to(torch.bfloat16)
    quantize_linears(layers[0], bits=4, keep_weights=False)
    quantize_linears(layers[1], bits=4, keep_weights=False, release_pages=True)
    with torch.inference_mode():
        assert torch.equal(layers[0](x), layers[1](x))
    assert layers[1].weight.is_meta


def test_int4_panels_decode_back_to_the_codes_weights():
    w = torch.randn(20, 320, generator=torch.Generator().manual_seed(1))
    for codes in (quantize_int4(w), _per_group_steps(quantize_int4(w))):
        layer = torch.nn.Linear(320, 20, bias=False).to(torch.bfloat16)
        quantize_linears(layer, bits=4, int4_codes={"": codes})
        assert torch.equal(int4_weights(layer), dequantize_int4(codes))


@pytest.mark.parametrize("k", [32, 96, 896])
@pytest.mark.parametrize("n", [1, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_kernel_matches_the_dequantized_linear(k, n, bias):
    for m in (1, 2, 3, 5, 6):
        x, w, b = linear_case(m, k, n, seed=k * 100 + n + m, bias=bias)
        codes = quantize_int4(w)
        for form in (codes, _per_group_steps(codes)):
            out = int4_linear(x, form, b)
            reference = _reference(x, form, b).float()
            assert out.dtype == torch.bfloat16 and out.shape == (m, n)
            torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=1e-4)


@pytest.mark.parametrize("m", [2, 3, 4, 7, 12, 13])
def test_int4_kernel_is_batch_invariant_bit_for_bit(m):
    x, w, b = linear_case(m, 160, 72, seed=m, bias=True)
    codes = quantize_int4(w)
    together = int4_linear(x, codes, b)
    for i in range(m):
        assert torch.equal(together[i], int4_linear(x[i : i + 1], codes, b)[0])


def test_int4_tile_on_avx512_vnni_is_bit_identical_to_avx2():
    # both tiles sum the same integers exactly; extreme groups (|xq| = 127 against
    # q = 15) check that neither saturates
    if not use_int4_vnni(True):
        pytest.skip("this CPU has no AVX-512 VNNI")
    x, w, b = linear_case(25, 896, 72, seed=5, bias=True)
    x[:, :32] = 100.0  # one group of equal, large activations: every xq = 127
    x[0, 32:64] = -3e4
    q, sc, ml, d, dl = quantize_int4(w)
    q[:, :64] = 15
    sc[:, 0], ml[:, 0], ml[:, 1] = 255, -128, 127  # extreme codes: exact products all the same
    try:
        for codes in ((q, sc, ml, d, dl), _per_group_steps((q, sc, ml, d, dl))):
            for m in range(1, 26):  # tiles of 1-12 tokens, and two or three blocks of them
                vnni = int4_linear(x[:m], codes, b)
                use_int4_vnni(False)
                avx2 = int4_linear(x[:m], codes, b)
                use_int4_vnni(True)
                assert torch.equal(vnni, avx2), m
    finally:
        use_int4_vnni(True)


@pytest.mark.parametrize("n", [16, 40])
def test_a_prefills_int4_product_on_amx_is_the_bfloat16_weights_product(n):
    # a prefill's many rows (cpu_linear.prefill_linear): the panels unpacked to bfloat16 on AMX
    # tiles, the activations as they are: the product of x with the weights rounded to
    # bfloat16, in float32 sums; rows in passes of 32 (padded past them), columns past N unused
    if not extension().bf16_amx_supported():
        pytest.skip("this CPU or OS has no AMX bfloat16 tiles")
    for m, bias in ((1, False), (17, True), (33, True), (150, False)):
        x, w, b = linear_case(m, 320, n, seed=m + n, bias=bias)
        for codes in (quantize_int4(w), _per_group_steps(quantize_int4(w))):
            panels, packed, steps = pack_int4_panels(*codes)
            shift = int4_shift(packed.shape[1], steps.shape[1])
            out = extension().linear_int4_prefill(x, panels, n, packed, steps, shift, b)
            weight = dequantize_int4(codes).bfloat16().float()
            reference = F.linear(x.float(), weight, None if b is None else b.float())
            assert out.dtype == torch.bfloat16 and out.shape == (m, n)
            torch.testing.assert_close(out.float(), reference, rtol=2**-7, atol=1e-3)


def test_int4_kernel_refuses_bad_arguments():
    x, w, _ = linear_case(2, 64, 8, seed=0, bias=False)
    panels, codes, steps = pack_int4_panels(*quantize_int4(w))
    kernel = extension().linear_int4_packed
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(x[:, :48].contiguous(), panels, 8, codes, steps, 3, None)
    with pytest.raises(RuntimeError, match="uint8 panels"):
        kernel(x, panels.to(torch.int8), 8, codes, steps, 3, None)
    with pytest.raises(RuntimeError, match="uint8 codes"):
        kernel(x, panels, 8, codes[:, :1].contiguous(), steps, 3, None)
    with pytest.raises(RuntimeError, match="float16 steps"):
        kernel(x, panels, 8, codes, steps, 0, None)  # 1 block where 2 groups want 2
    with pytest.raises(RuntimeError, match="shift"):
        kernel(x, panels, 8, codes, steps, -1, None)
    layer = torch.nn.Linear(64, 8).to(torch.bfloat16)
    q, sc, ml, d, dl = quantize_int4(w)
    with pytest.raises(ValueError, match="int4 codes for a"):
        quantize_linears(layer, bits=4, int4_codes={"": (q, sc, ml, d)})
    with pytest.raises(ValueError, match="blocks of steps"):
        quantize_linears(layer, bits=4, int4_codes={"": (q, sc, ml, d[:, :0], dl[:, :0])})


def test_quantize_linears_4_bit_keeps_the_state_dict_and_a_tied_head_on_int8():
    model = tiny_qwen2(seed=3).to(torch.bfloat16)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    with torch.no_grad():
        plain = model(ids).logits
        assert quantize_linears(model, bits=4) == linears
        assert quantize_linears(model, bits=4) == linears  # idempotent
        assert hasattr(model.lm_head, "_specdecode_qweight")  # tied: int8
        assert hasattr(model.model.layers[0].mlp.up_proj, "_specdecode_q4")
        int4 = model(ids).logits
        assert restore_linears(model) == linears
        again = model(ids).logits
    assert all(torch.equal(state[name], t) for name, t in model.state_dict().items())
    assert not any("_specdecode" in name for name, _ in model.named_buffers())
    assert not torch.equal(int4, plain)
    # 4 bits on random Gaussian weights: logits within about a quarter of their norm (0.24
    # measured), the same next tokens
    assert (int4.float() - plain.float()).norm() <= 0.35 * plain.float().norm()
    assert (int4.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.8
    assert torch.equal(again, plain)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quantize_linears(model, bits=2)


def test_int4_layer_falls_back_for_float32_and_autograd():
    layer = torch.nn.Linear(64, 16).to(torch.bfloat16)
    quantize_linears(layer, bits=4)
    x = torch.randn(3, 64)
    with torch.no_grad():
        kernel = layer(x.bfloat16()).float()
    expected = F.linear(x, int4_weights(layer), layer.bias.float())
    torch.testing.assert_close(kernel, expected, rtol=2**-7, atol=2e-2)
    x_grad = x.bfloat16().requires_grad_()
    layer(x_grad).float().sum().backward()
    assert x_grad.grad is not None


def test_int4_draft_spec(tmp_path):
    folder = tmp_path / "tiny"
    tiny_llama(seed=0).to(torch.bfloat16).save_pretrained(folder)
    draft = resolve_draft(f"{folder}:int4", None, dtype="bfloat16", device="cpu")
    # which path its tile runs on (tests/test_kernel_names.py: where the CPU has AVX-512 VNNI)
    assert draft.kernel == ("int4-avx512vnni" if int4_vnni_on() else "int4-avx2")
    assert draft.name.endswith(":int4")
    assert any(hasattr(m, "_specdecode_q4") for m in draft.model.modules())
    with pytest.raises(ValueError, match="int4 drafts run on the CPU kernel"):
        resolve_draft(f"{folder}:int4", None, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="quantizes a draft model"):
        resolve_draft("ngram:int4", None)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2])
def test_speculative_decoding_with_a_4_bit_draft_is_lossless(factory):
    target = factory(seed=0)
    draft = noisy_copy(target, 0.05).to(torch.bfloat16)
    quantize_linears(draft, bits=4)
    prompt = [1, 2, 3]
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
    # a fixed k: acceptance at the k named, not at what this machine's timings would choose
    for kwargs in ({"k": 4}, {"tree": "dynamic:6"}):
        result = SpeculativeDecoder(target, draft, k_policy="fixed", **kwargs).generate(
            prompt, max_new_tokens=40
        )
        assert result.token_ids == expected, kwargs
        assert result.stats.acceptance_rate > 0.2, kwargs


def test_int4_kernel_turns_non_finite_activations_into_nan_outputs():
    x, w, _ = linear_case(3, 64, 16, seed=5, bias=False)
    x[0, 3], x[1, 40] = float("inf"), float("nan")
    codes = quantize_int4(w)
    out = int4_linear(x, codes, None).float()
    assert out[:2].isnan().all() and out[2].isfinite().all()
    assert torch.equal(out[2], int4_linear(x[2:], codes, None).float()[0])
