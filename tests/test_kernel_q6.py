"""6-bit panels (GGUF Q6_K's grid, w = d * sc * (q - 32)): the packing round-trips exactly, the
kernel computes x @ w^T on activations quantized to 8 bits per token and group of 32 k up to one
bfloat16 rounding, without saturating at the extremes, batch invariant bit for bit; the layer
falls back to PyTorch for inputs the kernel does not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.kernels.build import extension, use_int4_vnni
from specdecode.kernels.quantize import _quantize_q6, pack_q6_panels, q6_weights

from conftest import linear_case, needs_kernel

pytestmark = needs_kernel()


def random_codes(n: int, k: int, seed: int):
    """q [N, K] in 0..63, sc [N, K / 16] int8 (both signs), d [N, K / 256] float16 > 0, sized
    so that w stays O(1 / sqrt(K))."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8)
    sc = torch.randint(-128, 128, (n, k // 16), generator=gen).to(torch.int8)
    d = (torch.rand(n, k // 256, generator=gen) * 2 + 1) / (32 * 128 * k**0.5)
    return q, sc, d.half()


def dequantized(q, sc, d) -> torch.Tensor:
    """d * sc * (q - 32), [N, K] float32 (exact: 11 + 8 + 6 significant bits)."""
    scale = sc.float().repeat_interleave(16, 1) * d.float().repeat_interleave(256, 1)
    return scale * (q.float() - 32)


def q6_linear(x, q, sc, d, b):
    """The kernel call a 6-bit layer makes, on the codes packed into panels first."""
    return extension().linear_q6_packed(x, *pack_q6_panels(q, sc, d), q.shape[0], b)


def _reference(x, w, b):
    """What the kernel computes, in float64: the exact product of w with x quantized to 8 bits
    per group of 32 (xq dx, dx = max |x| / 127)."""
    m, k = x.shape
    groups = x.double().reshape(m, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)  # [M, G, 1]
    inv = torch.full_like(amax, 127).float() / amax.float()  # as the kernel rounds 127 / amax
    inv = torch.where(amax > 0, inv, torch.zeros_like(inv))
    xq = torch.round(groups.float() * inv).double() * (amax / 127)
    out = xq.reshape(m, k) @ w.double().T
    return out if b is None else out + b.double()


def _layer(q, sc, d, bias=None) -> torch.nn.Linear:
    layer = torch.nn.Linear(q.shape[1], q.shape[0], bias=bias is not None).bfloat16()
    if bias is not None:
        with torch.no_grad():
            layer.bias.copy_(bias)
    _quantize_q6(layer, (q, sc, d))
    return layer


@pytest.mark.parametrize("n", [1, 16, 40])
def test_q6_packing_round_trips_exactly(n):
    q, sc, d = random_codes(n, 512, seed=n)
    assert torch.equal(q6_weights(_layer(q, sc, d)), dequantized(q, sc, d))


@pytest.mark.parametrize("k", [256, 768])
@pytest.mark.parametrize("n", [1, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_q6_kernel_matches_the_dequantized_linear(k, n, bias):
    for m in (1, 2, 3, 4, 5, 9):
        x, _, b = linear_case(m, k, n, seed=k * 100 + n + m, bias=bias)
        q, sc, d = random_codes(n, k, seed=k + n + m)
        out = q6_linear(x, q, sc, d, b)
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        reference = _reference(x, dequantized(q, sc, d), b).float()
        torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=1e-4)


def test_q6_kernel_does_not_saturate_at_the_extremes():
    # every product at its largest: q = 63 (or 0) against |xq| = 127, sc = -128 and 127
    n, k = 16, 512
    q = torch.full((n, k), 63, dtype=torch.uint8)
    q[8:] = 0
    sc = torch.full((n, k // 16), 127, dtype=torch.int8)
    sc[:, ::2] = -128
    d = torch.full((n, k // 256), 2.0**-14).half()
    x = torch.full((3, k), 1.5).bfloat16()
    x[1] = -1.5
    out = q6_linear(x, q, sc, d, None)
    torch.testing.assert_close(out.float(), _reference(x, dequantized(q, sc, d), None).float())


@pytest.mark.parametrize("m", [2, 3, 4, 7, 12, 13])
def test_q6_kernel_is_batch_invariant_bit_for_bit(m):
    x, _, b = linear_case(m, 512, 72, seed=m, bias=True)
    q, sc, d = random_codes(72, 512, seed=m)
    together = q6_linear(x, q, sc, d, b)
    for i in range(m):
        assert torch.equal(together[i], q6_linear(x[i : i + 1], q, sc, d, b)[0])


def test_q6_tile_on_avx512_vnni_is_bit_identical_to_avx2():
    # both tiles sum the same integers exactly (the VNNI switch covers the 6-bit tile too); the
    # extreme group (q = 63 and 0 against |xq| = 127, sc = -128 and 127) checks that neither
    # saturates, the random rest every lane of the top bits' layout
    if not use_int4_vnni(True):
        pytest.skip("this CPU has no AVX-512 VNNI")
    n, k = 40, 768
    x, _, b = linear_case(25, k, n, seed=7, bias=True)
    q, sc, d = random_codes(n, k, seed=7)
    x[:, :32] = 100.0  # one group of equal, large activations: every xq = 127
    x[0, 32:64] = -3e4
    q[:20, :32], q[20:, :32] = 63, 0
    sc[:, 0], sc[:, 1] = -128, 127
    try:
        for m in range(1, 26):  # tiles of 1-12 tokens, and two or three blocks of them
            vnni = q6_linear(x[:m], q, sc, d, b)
            use_int4_vnni(False)
            avx2 = q6_linear(x[:m], q, sc, d, b)
            use_int4_vnni(True)
            assert torch.equal(vnni, avx2), m
    finally:
        use_int4_vnni(True)


@pytest.mark.parametrize("n", [16, 40])
def test_a_prefills_6_bit_product_on_amx_is_the_bfloat16_weights_product(n):
    # as the 4-bit one's (test_kernel_int4): the panels unpacked to bfloat16 on AMX tiles
    if not extension().bf16_amx_supported():
        pytest.skip("this CPU or OS has no AMX bfloat16 tiles")
    q, sc, d = random_codes(n, 512, seed=n)
    q[0, :32] = 63  # the extremes of the top bits and the low nibble
    q[1, :32] = 0
    weight = dequantized(q, sc, d).bfloat16().float()
    for m, bias in ((1, False), (33, True), (150, False)):
        x, _, b = linear_case(m, 512, n, seed=m + n, bias=bias)
        out = extension().linear_q6_prefill(x, *pack_q6_panels(q, sc, d), n, b)
        reference = F.linear(x.float(), weight, None if b is None else b.float())
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        torch.testing.assert_close(out.float(), reference, rtol=2**-7, atol=1e-3)


def test_q6_layer_runs_the_kernel_and_falls_back_for_float32_and_autograd():
    q, sc, d = random_codes(24, 256, seed=3)
    x, _, b = linear_case(3, 256, 24, seed=3, bias=True)
    layer = _layer(q, sc, d, b)
    with torch.no_grad():
        assert torch.equal(layer(x), q6_linear(x, q, sc, d, b))
        fallback = layer(x.float())
    expected = F.linear(x.float(), dequantized(q, sc, d), b.float())
    torch.testing.assert_close(fallback, expected)
    x_grad = x.float().requires_grad_()
    layer(x_grad).sum().backward()
    assert x_grad.grad is not None


def test_q6_refuses_bad_shapes_and_arguments():
    q, sc, d = random_codes(16, 256, seed=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        pack_q6_panels(q[:, :128], sc[:, :8], d)
    x, _, _ = linear_case(2, 256, 16, seed=0, bias=False)
    lo, high, scales, ds = pack_q6_panels(q, sc, d)
    kernel = extension().linear_q6_packed
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernel(x[:, :128].contiguous(), lo, high, scales, ds, 16, None)
    with pytest.raises(RuntimeError, match="contiguous panels"):
        kernel(x, lo, high, scales.to(torch.uint8), ds, 16, None)


@pytest.mark.parametrize("vnni", [False, True])
@pytest.mark.parametrize("m", [1, 3, 13])
def test_a_group_of_linears_gives_each_its_own_calls_bits(m, vnni):
    """linear_group (a layer's q, k, v or gate, up in one parallel region): 4-bit and 6-bit
    members, with and without a bias, each output bit for bit its own call's."""
    from specdecode.kernels.cpu_linear import direct_linear
    from specdecode.kernels.quantize import _quantize_int4

    k = 512
    q6 = _layer(*random_codes(48, k, 5), bias=torch.randn(48).bfloat16())
    int4 = torch.nn.Linear(k, 80, bias=False).bfloat16()
    int4_bias = torch.nn.Linear(k, 16).bfloat16()
    for layer in (int4, int4_bias):
        _quantize_int4(layer)
    ops = [direct_linear(layer) for layer in (int4, q6, int4_bias, q6)]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    if vnni and not use_int4_vnni(True):
        pytest.skip("no AVX-512 VNNI on this CPU")
    try:
        use_int4_vnni(vnni)
        together = extension().linear_group(x, ops)
        alone = [op(x) for op in ops]
    finally:
        use_int4_vnni(True)
    assert [t.shape for t in together] == [(m, 80), (m, 48), (m, 16), (m, 48)]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
    with pytest.raises(RuntimeError, match="4-bit and 6-bit linears only"):
        rows = extension().LinearOp("rows", [torch.randn(16, k).bfloat16()], 16, 0, None)
        extension().linear_group(x, [rows])
