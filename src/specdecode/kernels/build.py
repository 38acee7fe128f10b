"""The compiled CPU kernels: one extension built on first use, and its process-wide switches.

`linear_avx2.cpp`, `linear_avx512.cpp`, `draft_ops.cpp` and `lean_layers.cpp` are compiled with PyTorch's C++
extension builder (a C++ compiler and ninja; once per machine, cached by PyTorch).
The switches choose between the AVX2 and AVX-512 paths where the CPU has both (cpu.py says which).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from specdecode.core.sampling import use_argmax_rows
from specdecode.kernels.cpu import BF16_AMX_ENV, BF16_DOT_ENV, torch_has_avx2

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "linear_avx2.cpp",
        "linear_avx512.cpp",
        "linear_amx.cpp",
        "draft_ops.cpp",
        "lean_layers.cpp",
    )
]
_HEADERS = [
    Path(__file__).with_name(name)
    for name in ("kernel_common.h", "int4_tile.h", "int4_codes512.h", "q6_tile.h", "kernel_ops.h")
]


class KernelUnavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


def unavailable_reason() -> str | None:
    """Why the kernel cannot be built or run on this machine, or None when it can."""
    if not torch_has_avx2():
        return f"the CPU has no AVX2 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    # slow import (setuptools with it, ~0.1 s): the kernels are imported by the command line's
    # parser; cpp_extension only to check, locate or build the extension
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) to build it with"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


BUILD_NAME = "specdecode_linear_avx2"
LOCK_TIMEOUT_ENV = "SPECDECODE_BUILD_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT_S = 600.0  # far longer than a build takes: a lock this old is stale


def build_directory() -> Path:
    """Where PyTorch builds and caches the extension: $TORCH_EXTENSIONS_DIR (or its default),
    then one folder per version of the kernels' sources (`source_digest`), so that checkouts and
    installs of the same sources share one build and two versions never rebuild over each
    other."""
    from torch.utils import cpp_extension  # slow import (setuptools): see unavailable_reason

    base = Path(cpp_extension._get_build_directory(BUILD_NAME, False))  # a private helper
    return base / source_digest()


def staged_sources(directory: Path) -> list[Path]:
    """The sources and headers copied into `directory`/src (where not there yet) -> the copied
    sources. The build names these paths whatever the checkout it came from: ninja rebuilds
    when a path in its build file changes, so building from the package's own paths rebuilt
    for every checkout or install path."""
    staged = directory / "src"
    staged.mkdir(parents=True, exist_ok=True)
    for path in (*_SOURCES, *_HEADERS):
        target, content = staged / path.name, path.read_bytes()
        if not target.exists() or target.read_bytes() != content:
            partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            partial.write_bytes(content)
            partial.replace(target)  # atomic: a concurrent build reads a whole file
    return [staged / path.name for path in _SOURCES]


def wait_for_build_lock(lock: Path, timeout_s: float, poll_s: float = 1.0) -> None:
    """Return once no other build holds `lock`; KernelUnavailable naming it once the lock is
    `timeout_s` old.

    PyTorch's builder waits without limit while its lock file exists, and a build killed midway
    leaves the file behind: every later process would hang. Here the wait ends when the lock is
    older than any build takes (at once for a lock left long ago), and the message names the
    file to remove."""
    told = False
    while True:
        try:
            age_s = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return  # no build holds it (or the one that did has finished)
        if age_s >= timeout_s:
            raise KernelUnavailable(
                f"the build lock {lock} is {age_s:.0f} s old: if no build is running (a killed "
                f"build leaves it behind), remove that file (${LOCK_TIMEOUT_ENV} sets how old "
                f"a lock may be, {timeout_s:.0f} s now)"
            )
        if not told:
            print(
                f"specdecode: waiting for another build of the CPU kernels ({lock})...",
                file=sys.stderr,
            )
            told = True
        time.sleep(min(poll_s, timeout_s - age_s))


@contextmanager
def _progress(
    message: str,
    first_after_s: float = 3.0,
    every_s: float = 15.0,
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Iterator[None]:
    """`say` `message` with the seconds spent, if the work inside lasts past `first_after_s`
    (a build: a cached load is silent), then every `every_s` seconds until it ends."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        wait = first_after_s
        while not done.wait(wait):
            say(f"{message} ({time.monotonic() - start:.0f} s)")
            wait = every_s

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


def _digest(paths: list[Path]) -> str:
    return hashlib.sha256(b"".join(path.read_bytes() for path in paths)).hexdigest()[:16]


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' C++ sources and headers: what a measured cost of them depends on
    beyond the package version (a calibration keys on it)."""
    return _digest([*_SOURCES, *_HEADERS])


@functools.cache
def extension() -> Any:
    """The compiled kernel module (built once per machine; PyTorch caches the build)."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(reason)
    from torch.utils import cpp_extension  # slow import (setuptools): see unavailable_reason

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    timeout_s = float(os.environ.get(LOCK_TIMEOUT_ENV, DEFAULT_LOCK_TIMEOUT_S))
    wait_for_build_lock(directory / "lock", timeout_s)
    # PyTorch rebuilds when a source or a flag changes, not a header: the headers' digest is a flag
    header = _digest(_HEADERS)
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", f"-DSPECDECODE_HEADER_{header}"]
    try:
        with _progress("specdecode: building the CPU kernels (once per machine)"):
            ext = cpp_extension.load(
                name=BUILD_NAME,
                sources=[str(source) for source in staged_sources(directory)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as err:  # a compiler or linker failure: report it, keep the model usable
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise KernelUnavailable(f"building it failed: {first}") from err
    ext.set_bf16_dot(os.environ.get(BF16_DOT_ENV, "1") != "0")
    ext.set_bf16_amx(os.environ.get(BF16_AMX_ENV, "1") != "0")
    use_argmax_rows(ext.argmax_rows)  # greedy decoding's argmax on CPU logits (sampling.py)
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


_int8_avx512: bool | None = None  # the int8 tile's switch as last set here (None: never set)


def use_int8_avx512(on: bool = True) -> bool:
    """Run the int8 tile on AVX-512 F where the CPU has it (the default) or on AVX2: the same
    results bit for bit, for comparisons. Returns whether AVX-512 is in use now."""
    global _int8_avx512
    _int8_avx512 = bool(extension().set_int8_avx512(on))
    return _int8_avx512


def int8_avx512_on() -> bool:
    """Whether the int8 tile runs on AVX-512 F now (the switch's default until set, as
    int4_vnni_on)."""
    return use_int8_avx512(True) if _int8_avx512 is None else _int8_avx512


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


def use_bf16_amx(on: bool = True) -> bool:
    """Run bfloat16 panels whose K is a multiple of 32 on AMX tiles where the CPU and the OS allow
    it (the default; `$SPECDECODE_BF16_AMX` = 0 turns it off), else on the path `use_bf16_dot`
    chose. Returns whether AMX is in use now. One switch for the process, as there."""
    return bool(extension().set_bf16_amx(on))


def bf16_amx_on() -> bool:
    """Whether bfloat16 panels (K a multiple of 32) run on AMX tiles now."""
    return bool(extension().bf16_amx_on())


def panels_isa() -> str:
    """What bfloat16 panels run on now: "amx-bf16" (K a multiple of 32; others as without it),
    "avx512-bf16" or "avx2-fma"."""
    if bf16_amx_on():
        return "amx-bf16"
    return "avx512-bf16" if bf16_dot_on() else "avx2-fma"
