"""The compiled CPU kernels: one extension built on first use, and its process-wide switches.

`linear_avx2.cpp`, `linear_avx512.cpp` and `draft_ops.cpp` are compiled with PyTorch's C++
extension builder (a C++ compiler and ninja; about a minute, once per machine, cached by PyTorch).
The switches choose between the AVX2 and AVX-512 paths where the CPU has both (cpu.py says which).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from specdecode.kernels.cpu import BF16_DOT_ENV

_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("linear_avx2.cpp", "linear_avx512.cpp", "draft_ops.cpp")
]
_HEADERS = [Path(__file__).with_name(name) for name in ("kernel_common.h", "int4_tile.h")]


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built or run on this machine, or None when it can."""
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX2" not in capability and "AVX512" not in capability:
        return f"the CPU has no AVX2 (PyTorch reports {capability})"
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) to build it with"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@functools.cache
def extension() -> Any:
    """The compiled kernel module (built once per machine; PyTorch caches the build)."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(reason)
    from torch.utils import cpp_extension

    name = "specdecode_linear_avx2"
    try:  # a private helper of PyTorch's: only to say that a build is coming
        built = any(Path(cpp_extension._get_build_directory(name, False)).glob(f"{name}*.so"))
    except Exception:
        built = False
    if not built:
        print(
            "specdecode: building the CPU kernels (once per machine, about a minute)...",
            file=sys.stderr,
        )
    # PyTorch rebuilds when a source or a flag changes, not a header: the headers' digest is a flag
    header = hashlib.sha256(b"".join(h.read_bytes() for h in _HEADERS)).hexdigest()[:16]
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", f"-DSPECDECODE_HEADER_{header}"]
    try:
        ext = cpp_extension.load(
            name=name,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # a compiler or linker failure: report it, keep the model usable
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise KernelUnavailable(f"building it failed: {first}") from err
    ext.set_bf16_dot(os.environ.get(BF16_DOT_ENV, "1") != "0")
    return ext


def use_bf16_dot(on: bool = True) -> bool:
    """Run bfloat16 panels on AVX-512 BF16 where the CPU has it (the default; `$SPECDECODE_BF16_DOT`
    = 0 turns it off) or on AVX2 FMAs. Returns whether AVX-512 BF16 is in use now. One switch for
    the process: the two paths round differently, so decoding and verification must share one."""
    return bool(extension().set_bf16_dot(on))


def bf16_dot_on() -> bool:
    """Whether bfloat16 panels run on AVX-512 BF16 now."""
    return bool(extension().bf16_dot_on())


_int4_vnni: bool | None = None  # the int4 tile's switch as last set here (None: never set)


def use_int4_vnni(on: bool = True) -> bool:
    """Run the int4 tile on AVX-512 VNNI where the CPU has it (the default) or on AVX2: the same
    results bit for bit, for comparisons. Returns whether AVX-512 VNNI is in use now."""
    global _int4_vnni
    _int4_vnni = bool(extension().set_int4_vnni(on))
    return _int4_vnni


def int4_vnni_on() -> bool:
    """Whether the int4 tile runs on AVX-512 VNNI now. The extension has no getter for it: until
    `use_int4_vnni` is called the switch is at its default, on where the CPU has it, which
    setting it on again leaves as it is."""
    return use_int4_vnni(True) if _int4_vnni is None else _int4_vnni


MAX_PREFETCH = 1 << 20  # elements (2 MB) ahead: far past any useful distance, never overflows
DEFAULT_PREFETCH = 2048  # the kernel's own default (linear_avx512.cpp), to restore it


def bf16_dot_prefetch(elements: int | None = None) -> int:
    """The AVX-512 BF16 panels' software-prefetch distance within a panel, in elements
    (DEFAULT_PREFETCH until set); `elements` sets it first. For tuning on another CPU
    (benchmarks/kernel_rate.py --prefetch): it changes speed only, never a result."""
    if elements is not None and not 1 <= elements <= MAX_PREFETCH:
        raise ValueError(
            f"a prefetch distance is 1..{MAX_PREFETCH} elements (got {elements}): a few KB ahead"
        )
    return int(extension().bf16_dot_prefetch(elements or 0))


def panels_isa() -> str:
    """What bfloat16 panels run on now: "avx512-bf16" or "avx2-fma"."""
    return "avx512-bf16" if bf16_dot_on() else "avx2-fma"
