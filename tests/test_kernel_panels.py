"""The kernel's bfloat16 packed panels: the layout, the outer-product tiles (same results as
PyTorch up to rounding, batch invariant for every token count's tiling, on AVX2 FMAs and, where
the CPU has it, on AVX-512 BF16), and weights packed in
place that the rest of the world still sees in their usual layout (state dict, loading,
training, int8). The int8 panels are tested in test_kernel_int8.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode.kernels import quantize_linears, restore_linears, swap_linears
from specdecode.kernels.build import (
    DEFAULT_PREFETCH,
    bf16_dot_prefetch,
    extension,
    panels_isa,
    use_bf16_amx,
    use_bf16_dot,
)
from specdecode.kernels.panels import pack_panels, row_major, unpack_panels
from specdecode.kernels.quantize import int8_weights, quantize_int8

from conftest import linear_case, needs_kernel, tiny_llama, tiny_qwen2

pytestmark = needs_kernel()


@pytest.fixture(params=["avx2-fma", "avx512-bf16", "amx-bf16"])
def isa(request):
    """Run the test with bfloat16 panels on each instruction set this CPU has, then restore."""
    wanted = request.param
    dot = use_bf16_dot(wanted != "avx2-fma")
    amx = use_bf16_amx(wanted == "amx-bf16")
    if (wanted == "avx512-bf16" and not dot) or (wanted == "amx-bf16" and not amx):
        use_bf16_dot(True)
        use_bf16_amx(True)
        pytest.skip(f"this CPU (or OS) has no {wanted}")
    assert panels_isa() == wanted
    yield wanted
    use_bf16_dot(True)  # the defaults
    use_bf16_amx(True)


def packed_linear(x, w, b):
    return extension().linear_packed(x, pack_panels(w), w.shape[0], b)


def test_layout_round_trips_and_pads_with_zeros():
    w = torch.arange(20 * 6, dtype=torch.float32).reshape(20, 6)
    panels = pack_panels(w)
    assert panels.shape == (2, 3, 16, 2)
    assert panels[0, 1, 5].tolist() == [w[5, 2].item(), w[5, 3].item()]  # row 5, k = 2 and 3
    assert panels[1, 2, 3].tolist() == [w[19, 4].item(), w[19, 5].item()]
    assert not panels[1, :, 4:].any()  # rows 20..31 do not exist: zeros
    assert torch.equal(unpack_panels(panels, 20, 6), w)
    for dtype in (torch.bfloat16, torch.float32):  # whole lanes without a gradient, or not
        weight = torch.randn(33, 10).to(dtype)
        packed = pack_panels(weight).requires_grad_()
        with torch.no_grad():
            assert torch.equal(unpack_panels(packed, 33, 10), weight)
        assert torch.equal(unpack_panels(packed, 33, 10).detach(), weight)


def test_a_prefills_many_rows_go_to_pytorchs_product_where_it_is_chosen(monkeypatch):
    from specdecode.kernels.panels import PREFILL_ENV, PREFILL_ROWS

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    inputs = {m: torch.randn(1, m, 64, generator=torch.Generator().manual_seed(m)).bfloat16()
              for m in (5, PREFILL_ROWS + 1)}  # fmt: skip
    swap_linears(torch.nn.Sequential(linear))
    with torch.inference_mode():
        monkeypatch.setenv(PREFILL_ENV, "kernel")
        on_panels = {m: linear(x) for m, x in inputs.items()}
        monkeypatch.setenv(PREFILL_ENV, "torch")
        chosen = {m: linear(x) for m, x in inputs.items()}
        reference = {m: F.linear(x, row_major(linear), linear.bias) for m, x in inputs.items()}
    assert torch.equal(chosen[5], on_panels[5])  # few rows stay on the panels
    assert torch.equal(chosen[PREFILL_ROWS + 1], reference[PREFILL_ROWS + 1])
    torch.testing.assert_close(chosen[PREFILL_ROWS + 1], on_panels[PREFILL_ROWS + 1])


# K even: below a pair of 16-wide lines, ragged, long; N: below, at and across panel edges
@pytest.mark.parametrize("k", [2, 16, 38, 100, 256])
@pytest.mark.parametrize("n", [1, 8, 16, 40, 72])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_pytorch_up_to_bfloat16_rounding(k, n, bias, isa):
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 17, 25, 32, 40, 49):
        x, w, b = linear_case(m, k, n, seed=k * 100 + n + m, bias=bias)
        out = packed_linear(x, w, b)
        reference = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("m", [2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 16, 19, 25, 32, 33, 50, 70])
@pytest.mark.parametrize("n", [72, 200])
def test_batch_invariant_bit_for_bit(m, n, isa):
    # every token count tiles differently (groups of 1, 2 or 4 panels; blocks of 3-12 tokens, or
    # of 4-6 and a padded row on AVX2; on AMX passes of 32 and a last one padded to 16 or 32);
    # a token's output is the same float whichever
    x, w, b = linear_case(m, 1536, n, seed=m, bias=True)
    panels = pack_panels(w)
    together = extension().linear_packed(x, panels, n, b)
    for i in range(m):
        alone = extension().linear_packed(x[i : i + 1], panels, n, b)
        assert torch.equal(together[i], alone[0]), i


def test_the_two_instruction_sets_agree_up_to_rounding():
    amx = use_bf16_amx(False)  # K = 1536 would take the AMX tiles
    if not use_bf16_dot(True):
        pytest.skip("this CPU has no AVX-512 BF16")
    x, w, b = linear_case(9, 1536, 200, seed=0, bias=True)
    panels = pack_panels(w)
    dot = extension().linear_packed(x, panels, 200, b)
    use_bf16_dot(False)
    fma = extension().linear_packed(x, panels, 200, b)
    use_bf16_dot(True)
    assert panels_isa() == "avx512-bf16"
    # two float32 sums in different orders, each rounded once to bfloat16
    torch.testing.assert_close(dot.float(), fma.float(), rtol=2**-7, atol=1e-4)
    if use_bf16_amx(amx):  # the AMX tiles, where this CPU has them: a third order
        tiles = extension().linear_packed(x, panels, 200, b)
        assert panels_isa() == "amx-bf16"
        torch.testing.assert_close(tiles.float(), dot.float(), rtol=2**-7, atol=1e-4)


def test_bad_arguments_are_refused():
    x, w, _ = linear_case(2, 16, 16, seed=0, bias=False)
    with pytest.raises(RuntimeError, match="K even"):
        extension().linear_packed(x[:, :15].contiguous(), pack_panels(w), 16, None)
    with pytest.raises(RuntimeError, match="ceil"):
        extension().linear_packed(x, pack_panels(w), 17, None)


def _weights(model):
    return {name: t.clone() for name, t in model.state_dict().items()}


def test_packed_in_place_yet_the_state_dict_shows_the_usual_layout():
    model = tiny_qwen2(seed=3).to(torch.bfloat16)
    before = _weights(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    usual = q_proj.weight.detach().clone()
    swap_linears(model)
    assert getattr(q_proj, "_specdecode_packed", False)
    assert not torch.equal(q_proj.weight, usual)  # the storage holds the panels now
    assert torch.equal(row_major(q_proj), usual)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], t) for name, t in before.items())


def test_loading_a_state_dict_into_a_packed_model_packs_it():
    source = tiny_llama(seed=5).to(torch.bfloat16)
    model = tiny_llama(seed=6).to(torch.bfloat16)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    swap_linears(source)
    swap_linears(model)
    with torch.no_grad():
        model.load_state_dict(source.state_dict())
        assert torch.equal(model(ids).logits, source(ids).logits)
        model.load_state_dict(source.state_dict(), strict=False)  # loading twice: no double pack
        assert torch.equal(model(ids).logits, source(ids).logits)
    restore_linears(model)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in _weights(source).items())


def test_tied_output_layer_gets_its_own_panels_and_the_embedding_stays():
    model = tiny_llama(seed=2, tie_word_embeddings=True).to(torch.bfloat16)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.weight is embed.weight
    table = embed.weight.detach().clone()
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        plain = model(ids).logits
        swap_linears(model)
        fast = model(ids).logits
    assert torch.equal(embed.weight, table)
    assert not getattr(head, "_specdecode_packed", False)
    assert head._buffers["_specdecode_panels"].shape == (96 // 16, 16, 16, 2)
    assert "lm_head._specdecode_panels" not in model.state_dict()
    torch.testing.assert_close(fast.float(), plain.float(), rtol=0.05, atol=0.05)
    restore_linears(model)
    assert "_specdecode_panels" not in head._buffers


def test_training_gradients_reach_the_packed_weight():
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16)
    reference = torch.nn.Linear(32, 16).to(torch.bfloat16)
    reference.load_state_dict(layer.state_dict())
    swap_linears(layer)
    x = torch.randn(3, 32).bfloat16()
    layer(x).float().sum().backward()
    reference(x).float().sum().backward()
    # the gradient lives in the parameter's (packed) layout: unpacked, it is PyTorch's own
    assert torch.equal(unpack_panels(layer.weight.grad, 16, 32), reference.weight.grad)


def test_int8_quantizes_the_usual_layout():
    model = tiny_llama(seed=4).to(torch.bfloat16)
    o_proj = model.model.layers[1].self_attn.o_proj
    expected, _ = quantize_int8(o_proj.weight.detach())
    swap_linears(model)
    quantize_linears(model)
    assert torch.equal(int8_weights(o_proj)[0], expected)


def test_odd_k_stays_on_the_row_kernel():
    layer = torch.nn.Linear(33, 16).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    swap_linears(layer)
    assert not getattr(layer, "_specdecode_packed", False)
    assert torch.equal(layer.weight, weight)
    x = torch.randn(4, 33).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x).float(),
            F.linear(x.float(), weight.float(), layer.bias.float()),
            rtol=2**-8,
            atol=1e-5,
        )


def test_prefetch_distance_changes_no_result():
    """The AVX-512 BF16 panels' prefetch distance (a tuning knob) is speed only."""
    if not use_bf16_dot(True):
        pytest.skip("this CPU has no AVX-512 BF16")
    assert bf16_dot_prefetch() == DEFAULT_PREFETCH == 2048  # as linear_avx512.cpp starts
    torch.manual_seed(0)
    w, b = torch.randn(72, 256).bfloat16(), torch.randn(72).bfloat16()
    x = torch.randn(12, 256).bfloat16()
    expected = packed_linear(x, w, b)
    try:
        for elements in (1, 64, 8192, 1 << 20):
            assert bf16_dot_prefetch(elements) == elements
            assert torch.equal(packed_linear(x, w, b), expected)
        for bad in (0, (1 << 20) + 1):
            with pytest.raises(ValueError, match="prefetch distance"):
                bf16_dot_prefetch(bad)
    finally:
        bf16_dot_prefetch(DEFAULT_PREFETCH)
