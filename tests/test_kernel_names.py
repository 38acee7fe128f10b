"""The kernel names say which path runs (bf16-avx2 / bf16-avx512, int8-avx2 / int8-avx512,
int4-avx2 / int4-avx512vnni): the CPU flags and the extension's switches injected, so that the AVX-512 names
are tested on any machine; and, where the kernel builds, Python's reading of the CPU flags
against the extension's own."""

from __future__ import annotations

import os

import pytest
import torch

from specdecode.kernels import apply_kernel, build, cpu, cpu_linear, quantize

from conftest import needs_kernel, tiny_llama

AVX2_ONLY = frozenset({"sse2", "avx", "avx2", "fma", "f16c"})  # e.g. AMD Zen 2
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}


def test_cpu_flags_are_read_from_every_core(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx512_bf16\n"
    )
    assert cpu.cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "fma", "avx512_bf16"}
    assert cpu.cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (AVX2_ONLY, None, False),
        (AVX512_BF16, None, True),
        (AVX512_BF16, "1", True),
        (AVX512_BF16, "0", False),  # $SPECDECODE_BF16_DOT=0: AVX2 FMAs even there
        (AVX512_BF16 - {"avx512_bf16"}, None, False),  # AVX-512 without BF16
    ],
)
def test_the_panels_path_is_told_from_the_cpu_flags(monkeypatch, flags, env, expected):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    if env is None:
        monkeypatch.delenv(cpu.BF16_DOT_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu.BF16_DOT_ENV, env)
    assert cpu.has_avx512_bf16() == ("avx512_bf16" in flags)
    assert cpu.bf16_dot_expected() is expected
    assert cpu.bf16_name(cpu.bf16_dot_expected()) == ("bf16-avx512" if expected else "bf16-avx2")


def test_names():
    assert (cpu.bf16_name(False), cpu.bf16_name(True)) == ("bf16-avx2", "bf16-avx512")
    assert cpu.bf16_name(True, amx=True) == "bf16-amx"
    assert (cpu.int4_name(False), cpu.int4_name(True)) == ("int4-avx2", "int4-avx512vnni")
    assert (cpu.int8_name(False), cpu.int8_name(True)) == ("int8-avx2", "int8-avx512")


def test_quant_names_follow_the_switches(monkeypatch):
    monkeypatch.setattr(quantize, "int4_vnni_on", lambda: True)
    monkeypatch.setattr(quantize, "int8_avx512_on", lambda: True)
    assert (quantize.quant_name(8), quantize.quant_name(4)) == ("int8-avx512", "int4-avx512vnni")
    monkeypatch.setattr(quantize, "int4_vnni_on", lambda: False)
    monkeypatch.setattr(quantize, "int8_avx512_on", lambda: False)
    assert (quantize.quant_name(8), quantize.quant_name(4)) == ("int8-avx2", "int4-avx2")
    with pytest.raises(ValueError, match="8 or 4 bits"):
        quantize.quant_name(2)


@needs_kernel()
@pytest.mark.parametrize(
    ("dot", "amx", "name"),
    [(False, False, "bf16-avx2"), (True, False, "bf16-avx512"), (True, True, "bf16-amx")],
)
def test_apply_kernel_names_the_path_of_the_panels(monkeypatch, dot, amx, name):
    # as on a CPU with AMX, with AVX-512 BF16 (the switches on) or on an AVX2 one
    monkeypatch.setattr(
        torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if dot else "AVX2"
    )
    monkeypatch.setattr(cpu, "cpu_flags", lambda: AVX512_BF16 if dot else AVX2_ONLY)
    monkeypatch.setattr(cpu_linear, "bf16_dot_on", lambda: dot)
    monkeypatch.setattr(cpu_linear, "bf16_amx_on", lambda: amx)
    model = tiny_llama(seed=1).to(torch.bfloat16)
    assert apply_kernel(model, "on") == name
    assert apply_kernel(model, "auto") == name  # AVX2 or AVX-512 BF16: auto takes it too
    assert apply_kernel(model, "off") == "eager"


@needs_kernel()
def test_int4_draft_is_named_by_its_tile(monkeypatch, tmp_path):
    from specdecode.drafters import resolve_draft

    monkeypatch.setattr(quantize, "int4_vnni_on", lambda: True)  # as on an AVX-512 VNNI CPU
    folder = tmp_path / "tiny"
    tiny_llama(seed=0).to(torch.bfloat16).save_pretrained(folder)
    draft = resolve_draft(f"{folder}:int4", None, dtype="bfloat16", device="cpu")
    assert draft.kernel == "int4-avx512vnni"


@needs_kernel()
def test_the_cpu_flags_agree_with_the_extension():
    # the extension asks the CPU itself (__builtin_cpu_supports); cpu.py reads /proc/cpuinfo
    flags = cpu.cpu_flags()
    default = os.environ.get(cpu.BF16_DOT_ENV, "1") != "0"
    try:
        assert build.use_bf16_dot(True) == ({"avx512f", "avx512bw", "avx512_bf16"} <= flags)
        assert build.use_int4_vnni(True) == (
            {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags
        )
        assert build.use_int8_avx512(True) == ("avx512f" in flags)
    finally:
        build.use_bf16_dot(default)
    assert build.bf16_dot_on() == cpu.bf16_dot_expected()
    assert build.int4_vnni_on() == ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags)
    assert build.int8_avx512_on() == ("avx512f" in flags)
