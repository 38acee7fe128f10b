"""The bfloat16 CPU kernel: same results as PyTorch's linear up to rounding, batch invariant,
swapped in and out of a model without touching its weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdecode import SpeculativeDecoder
from specdecode.kernels import apply_kernel, cpu, restore_linears, swap_linears
from specdecode.kernels.build import extension, panels_isa

from conftest import linear_case, needs_kernel, noisy_copy, tiny_llama, tiny_qwen2

pytestmark = needs_kernel()


# K: below one 16-wide chunk, with a tail, exact chunks; N: below and around the 8-row group
@pytest.mark.parametrize("k", [5, 16, 37, 100, 256])
@pytest.mark.parametrize("n", [1, 8, 13, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_pytorch_up_to_bfloat16_rounding(k, n, bias):
    for m in (1, 2, 3, 4, 5, 7, 9, 17):
        x, w, b = linear_case(m, k, n, seed=k * 100 + n + m, bias=bias)
        out = extension().linear(x, w, b)
        reference = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert out.dtype == torch.bfloat16 and out.shape == (m, n)
        # one bfloat16 rounding of the float32 result: relative error at most 2^-8
        torch.testing.assert_close(out.float(), reference, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("m", [2, 3, 4, 5, 6, 8, 9, 13, 16])
def test_batch_invariant_bit_for_bit(m):
    # a token's output is the same float whether it is computed alone or among m tokens
    x, w, b = linear_case(m, 1536, 72, seed=m, bias=True)
    together = extension().linear(x, w, b)
    for i in range(m):
        alone = extension().linear(x[i : i + 1], w, b)
        assert torch.equal(together[i], alone[0]), i


def test_swap_keeps_weights_and_restores():
    model = tiny_qwen2(seed=3).to(torch.bfloat16)  # q/k/v projections carry biases
    state = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        plain = model(ids).logits
        linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert swap_linears(model) == linears
        assert swap_linears(model) == linears  # idempotent
        fast = model(ids).logits
        assert restore_linears(model) == linears
        again = model(ids).logits
    assert all(torch.equal(state[name], t) for name, t in model.state_dict().items())
    torch.testing.assert_close(fast.float(), plain.float(), rtol=0.05, atol=0.05)
    assert torch.equal(again, plain)


def test_training_falls_back_to_pytorch():
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16)
    swap_linears(layer)
    x = torch.randn(3, 32).bfloat16().requires_grad_()
    layer(x).float().sum().backward()  # the kernel has no backward: plain linear runs
    assert x.grad is not None and layer.weight.grad is not None


def test_modes():
    model = tiny_llama(seed=1).to(torch.bfloat16)
    assert apply_kernel(model, "on") == _bf16_kernel()
    assert apply_kernel(model, "off") == "eager"
    assert not any(hasattr(m, "_specdecode_kernel") for m in model.modules())
    float32 = tiny_llama(seed=1)
    assert apply_kernel(float32, "auto") == "eager"  # the kernel is for bfloat16 only
    with pytest.raises(ValueError, match="bfloat16 model on the CPU"):
        apply_kernel(float32, "on")
    with pytest.raises(ValueError, match="unknown kernel mode"):
        apply_kernel(model, "fast")


def test_environment_variable_sets_the_default(monkeypatch):
    model = tiny_llama(seed=1).to(torch.bfloat16)
    monkeypatch.setenv("SPECDECODE_KERNEL", "off")
    assert apply_kernel(model) == "eager"
    monkeypatch.setenv("SPECDECODE_KERNEL", "on")
    assert apply_kernel(model) == _bf16_kernel()


def _bf16_kernel() -> str:
    """A bfloat16 model's kernel name here: what its panels run on now."""
    return {"amx-bf16": "bf16-amx", "avx512-bf16": "bf16-avx512"}.get(panels_isa(), "bf16-avx2")


def _top2_margin(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_decoding_on_the_kernel_matches_its_own_greedy(factory, seed):
    # invariant 1 in bfloat16 with the linears on the kernel: the same tokens as the target's own
    # greedy decoding, or a first difference only at a near-tie of the target's logits
    target = factory(seed=seed).to(torch.bfloat16)
    draft = noisy_copy(target, 0.05, seed=seed).to(torch.bfloat16)
    apply_kernel(target, "on")
    apply_kernel(draft, "on")
    prompt = [1 + seed, 2, 3]
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=40).token_ids
    for kwargs in ({"k": 1}, {"k": 4}, {"tree": "static:3,2,1"}, {"tree": "dynamic:6"}):
        result = SpeculativeDecoder(target, draft, k_policy="fixed", **kwargs).generate(
            prompt, max_new_tokens=40
        )
        assert result.stats.acceptance_rate > 0
        if result.token_ids != expected:
            i = next(
                i for i, (a, b) in enumerate(zip(result.token_ids, expected, strict=True)) if a != b
            )
            margin = _top2_margin(target, prompt + expected[:i])
            assert margin <= 0.0625, (kwargs, i, margin)  # a few bfloat16 steps at |logit| ~ 2-8


def test_auto_takes_the_kernel_on_avx512_machines_without_bf16(monkeypatch):
    # as on Ice Lake: its panels on AVX2 FMAs beat PyTorch's own bfloat16 path there at every
    # token count (results.md, "bfloat16 on AVX-512 without BF16")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512bw"}))
    model = tiny_llama(seed=1).to(torch.bfloat16)
    assert apply_kernel(model, "auto") == _bf16_kernel()
    apply_kernel(model, "off")


def test_auto_stays_on_pytorch_without_avx2(monkeypatch, capsys):
    # nothing to choose there: no note, no build
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    model = tiny_llama(seed=1).to(torch.bfloat16)
    assert apply_kernel(model, "auto") == "eager"
    assert capsys.readouterr().err == ""


def test_auto_takes_the_kernel_on_avx512_bf16_machines(monkeypatch):
    # there its panels run on AVX-512 BF16 (lab/benchmarks.md: faster than PyTorch's path)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512_bf16"}))
    model = tiny_llama(seed=1).to(torch.bfloat16)
    assert apply_kernel(model, "auto") == _bf16_kernel()
    apply_kernel(model, "off")


def test_kernel_option_on_the_command_line_and_in_load_model():
    from specdecode.cli import build_parser
    from specdecode.models import load_model

    args = build_parser().parse_args(
        ["generate", "--target", "t", "--prompt", "hi", "--kernel", "off"]
    )
    assert args.kernel == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--kernel", "fast"])
    with pytest.raises(ValueError, match="unknown kernel mode"):
        load_model("no-such-model", kernel="fast")  # refused before anything is loaded


@pytest.mark.parametrize("kind", ["panels", "row-major", "int8", "int4"])
def test_direct_linear_computes_what_the_module_does(kind):
    from specdecode.kernels import quantize_linears
    from specdecode.kernels.cpu_linear import direct_linear

    k = 37 if kind == "row-major" else 64  # odd K: the row-major kernel; int4 needs 32 | K
    layer = torch.nn.Linear(k, 24, bias=True).to(torch.bfloat16)
    model = torch.nn.Sequential(layer)
    assert direct_linear(layer) is layer  # not on a kernel: the module itself
    swap_linears(model)
    if kind in ("int8", "int4"):
        quantize_linears(model, bits=int(kind[3]))
    call = direct_linear(layer)
    assert call is not layer
    with torch.inference_mode():
        for m in (1, 3, 6):
            x, _, _ = linear_case(m, k, 1, seed=m, bias=False)
            assert torch.equal(call(x), layer(x))


def test_argmax_rows_equals_torch_argmax_first_index_and_nans():
    # greedy decoding's argmax on the kernel: the same index as torch.argmax, bfloat16 and
    # float32, ties (the first index), NaNs (the first NaN), short rows and tails past 8
    from specdecode.core.sampling import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    for width in (1, 5, 8, 9, 31, 1000, 151_936):
        x = torch.randn(4, width, generator=gen)
        x[1] = x[1].round()  # many ties
        x[2, width // 2 :] = x[2].max() + 1  # a tie run at the top, in the tail for short rows
        if width > 3:
            x[3, width - 2] = float("nan")  # a NaN (in the tail, or not)
            x[3, width - 1] = float("nan")
        for dtype in (torch.float32, torch.bfloat16):
            logits = x.to(dtype)
            expected = logits.argmax(-1)
            assert torch.equal(extension().argmax_rows(logits), expected), (width, dtype)
            assert torch.equal(greedy_tokens(logits), expected)
            assert torch.equal(greedy_tokens(logits[0]), logits[0].argmax(-1))
    x = torch.full((2, 40), -torch.inf)
    x[1, 3] = float("nan")
    assert extension().argmax_rows(x).tolist() == x.argmax(-1).tolist() == [0, 3]
    with pytest.raises(RuntimeError, match="argmax_rows"):
        extension().argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
