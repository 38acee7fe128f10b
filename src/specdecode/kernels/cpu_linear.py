"""Swap a model's bfloat16 `nn.Linear` layers onto the CPU kernels, by mode (auto / on / off).

Only the layers' compute changes: module tree and the model's own forward stay as Hugging Face
built them. Weights are packed into the kernel's panels (panels.py); the extension is built on
first use (build.py); quantized drafts are quantize.py's.

Modes (`load_model(kernel=...)`, `--kernel`, or the `SPECDECODE_KERNEL` environment variable):
  auto  use it for bfloat16 models when it builds, on every CPU with AVX2 (AVX-512 ones
        without BF16 too, where it measured faster than PyTorch's own path: docs/results.md);
        otherwise plain PyTorch (default).
  on    use it, and fail with the reason when it cannot be used
  off   plain PyTorch

With the kernel, a model on SDPA attention also switches to `kernels/attention.py`'s attention
for few query tokens (`off` switches it back). The kernel name `apply_kernel` returns (and
`LoadedModel.kernel` shows) says which path the panels run on: cpu.BF16_AVX2, cpu.BF16_AVX512 or
cpu.BF16_AMX.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdecode.kernels.attention import restore_attention, use_decode_attention
from specdecode.kernels.build import KernelUnavailable, bf16_amx_on, bf16_dot_on, extension
from specdecode.kernels.cpu import bf16_name, torch_has_avx2
from specdecode.kernels.panels import (
    clear_forward,
    eligible,
    kernel_forward,
    on_kernel,
    pack,
    panels_call,
    prefill_on_torch,
    row_major,
    set_forward,
    shared_storages,
    unpack,
)
from specdecode.kernels.quantize import (
    amx_prefill_call,
    drop_quantized,
    is_quantized,
    quantized_call,
    weight_freed,
)

KERNEL_MODES = ("auto", "on", "off")
ENV = "SPECDECODE_KERNEL"


def swap_linears(model: torch.nn.Module, panels: bool = True) -> int:
    """Run every eligible bfloat16 CPU `nn.Linear` of `model` on the kernel; returns how many.

    Weights with an even K are packed into the kernel's 16-row panels (`pack_panels`): in place
    where nothing else shares the storage (the state dict still shows, and loads, the usual
    layout; `row_major` gives it), as a separate copy for tied ones; `panels=False` keeps every
    weight row-major on the kernel's row tiles (for comparisons). Builds the kernel first
    (KernelUnavailable when it cannot). Idempotent.
    """
    extension()
    count = 0
    shared = shared_storages(model)
    for module in model.modules():
        if eligible(module):
            if not on_kernel(module):
                if panels:
                    pack(module, shared)
                set_forward(module, kernel_forward)
            count += 1
    return count


def restore_linears(model: torch.nn.Module) -> int:
    """Undo `swap_linears` and `quantize_linears`: plain PyTorch linears on the model's own
    weights again (the int8 copies are dropped); returns how many were restored.

    ValueError, before anything changes, where quantized layers have no bfloat16 weight left to
    restore (`quantize_linears(keep_weights=False)`: a `MODEL:int4` / `MODEL:int8` target)."""
    freed = sum(1 for module in model.modules() if on_kernel(module) and weight_freed(module))
    if freed:
        raise ValueError(
            f"cannot restore the bfloat16 linears: {freed} quantized layer(s) freed their "
            "bfloat16 weights (a MODEL:int4 / MODEL:int8 target, quantize_linears(keep_weights="
            "False)); load the model again without the suffix to run it in bfloat16"
        )
    count = 0
    for module in model.modules():
        if on_kernel(module):
            clear_forward(module)
            unpack(module)
            drop_quantized(module)
            count += 1
    return count


def direct_linear(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """What computes `module(x)` for x [M, K] contiguous bfloat16 on the CPU with the fewest
    Python steps: the kernel call itself when `module` runs on one of specdecode's kernels (no
    nn.Module call, no input checks or reshapes: over a small draft's hundred-odd linears, a large
    share of its one-token forward; docs/results.md), else
    the module.

    It holds the module's weights as they are now: make it again after quantizing the model,
    moving it or restoring its linears.
    """
    if not on_kernel(module):
        return module
    ext = extension()
    return quantized_call(module, ext) or panels_call(module, ext)


def prefill_linear(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What computes `module(x)` for a prefill's many rows x [M, K] (bfloat16) where another
    product beats the kernel's tiles on this machine: for a bfloat16 linear on the panels,
    `F.linear` on the weight in its usual layout, unpacked for each call (no second copy kept),
    where PyTorch's product is the faster (`prefill_on_torch`); for a 4-bit or 6-bit one, its
    panels unpacked to bfloat16 on AMX tiles where that is (`amx_prefill_call`). None where the
    kernel call serves (an int8 layer keeps its tile; its bfloat16 weight may be gone)."""
    if not on_kernel(module):
        return None
    if is_quantized(module):
        return amx_prefill_call(module)
    if not prefill_on_torch():
        return None
    bias = module.bias
    return lambda x: F.linear(x, row_major(module), bias)


def resolve_mode(mode: str | None) -> str:
    mode = (mode or os.environ.get(ENV) or "auto").lower()
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}: choose one of {', '.join(KERNEL_MODES)}")
    return mode


_warned: set[str] = set()


def apply_kernel(model: torch.nn.Module, mode: str | None = None) -> str:
    """Apply the kernel policy `mode` (None: $SPECDECODE_KERNEL, else auto) to a loaded model.

    Returns the kernel its linears now run on: "bf16-avx2", "bf16-avx512" or "bf16-amx" (the
    panels on AVX2 FMAs, on AVX-512 BF16 or on AMX tiles, as build.use_bf16_dot and use_bf16_amx
    stand now), or "eager".
    """
    mode = resolve_mode(mode)
    if mode == "off":
        restore_linears(model)
        restore_attention(model)
        return "eager"
    first = next(model.parameters(), None)  # the model's dtype and device
    if first is None or first.dtype != torch.bfloat16 or first.device.type != "cpu":
        if mode == "on":
            raise ValueError("--kernel on needs a bfloat16 model on the CPU")
        return "eager"
    if mode == "auto" and not torch_has_avx2():
        return "eager"  # the tiles cannot run here: say nothing, PyTorch's path is the only one
    try:
        if not swap_linears(model):
            return "eager"
        use_decode_attention(model)  # the same switch: decoding's other hot spot on CPU
        return bf16_name(bf16_dot_on(), bf16_amx_on())
    except KernelUnavailable as err:
        if mode == "on":
            raise ValueError(f"the bfloat16 CPU kernel cannot be used: {err}") from err
        if str(err) not in _warned:  # auto: say once why decoding stays on plain PyTorch
            _warned.add(str(err))
            print(
                f"specdecode: note: bfloat16 linears stay on plain PyTorch, slower on this CPU, "
                f"because the AVX2 kernel cannot be used: {err}",
                file=sys.stderr,
            )
        return "eager"
