"""What this CPU runs the kernels on: its instruction sets, and the names that say which path runs.

The extension decides for itself at run time (linear_avx512.cpp, `__builtin_cpu_supports`): the
bfloat16 panels run on AMX tiles where the CPU has AMX-TILE and AMX-BF16, the OS lets the process
use them and $SPECDECODE_BF16_AMX is not 0 (linears whose K is a multiple of 32; linear_amx.cpp),
else on AVX-512 BF16 where the CPU has AVX-512 F, BW and BF16 and $SPECDECODE_BF16_DOT is not 0,
else on AVX2 FMAs; the 4-bit tile runs on AVX-512 VNNI where the
CPU has AVX-512 F, VL and VNNI, else on AVX2; the int8 tile on AVX-512 F where the CPU has it,
else on AVX2; the row-major tiles always run on AVX2.
What is here reads /proc/cpuinfo to tell in advance, without building anything.
"""

from __future__ import annotations

import os

BF16_DOT_ENV = "SPECDECODE_BF16_DOT"  # "0": bfloat16 panels on AVX2 FMAs even where AVX-512 BF16 is
BF16_AMX_ENV = (
    "SPECDECODE_BF16_AMX"  # "0": bfloat16 panels off AMX tiles even where the CPU has them
)

# what LoadedModel.kernel reports: the weights' type and the instruction set their tiles run on
BF16_AVX2 = "bf16-avx2"  # bfloat16 panels on AVX2 FMAs
BF16_AVX512 = "bf16-avx512"  # bfloat16 panels on AVX-512 BF16 dot products
BF16_AMX = "bf16-amx"  # bfloat16 panels on AMX tiles (K a multiple of 32; others as without)
INT8_AVX2 = "int8-avx2"  # after quantize_linears(bits=8), its tile on AVX2
INT8_AVX512 = "int8-avx512"  # ... on AVX-512 F
INT4_AVX2 = "int4-avx2"  # after quantize_linears(bits=4), its tile on AVX2
INT4_AVX512_VNNI = "int4-avx512vnni"  # ... on AVX-512 VNNI


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo, every core's; empty where unreadable)."""
    flags: set[str] = set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags.update(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset(flags)


def torch_has_avx2() -> bool:
    """Whether PyTorch finds AVX2 (or AVX-512, which every CPU with it pairs with AVX2 + FMA):
    what every tile here needs."""
    import torch  # here, so that reading the flags needs no torch

    capability = torch.backends.cpu.get_cpu_capability()
    return "AVX2" in capability or "AVX512" in capability


def has_avx512_bf16() -> bool:
    """Whether the CPU reports AVX-512 BF16 (False where /proc/cpuinfo is unreadable)."""
    return "avx512_bf16" in cpu_flags()


def bf16_dot_expected() -> bool:
    """Whether the bfloat16 panels will run on AVX-512 BF16 once the kernel is built: the CPU
    has it and $SPECDECODE_BF16_DOT is not 0. Builds nothing."""
    return has_avx512_bf16() and os.environ.get(BF16_DOT_ENV, "1") != "0"


def bf16_name(avx512_bf16: bool, amx: bool = False) -> str:
    """The kernel name of a model whose bfloat16 panels run on AMX tiles, on AVX-512 BF16, or on
    neither."""
    if amx:
        return BF16_AMX
    return BF16_AVX512 if avx512_bf16 else BF16_AVX2


def int8_name(avx512: bool) -> str:
    """The kernel name of an int8 model whose tile runs on AVX-512 F or not."""
    return INT8_AVX512 if avx512 else INT8_AVX2


def int4_name(avx512_vnni: bool) -> str:
    """The kernel name of a 4-bit model whose tile runs on AVX-512 VNNI or not."""
    return INT4_AVX512_VNNI if avx512_vnni else INT4_AVX2
