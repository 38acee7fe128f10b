"""Swap a model's bfloat16 `nn.Linear` layers onto the AVX2 kernels in `linear_avx2.cpp`.

Only the layers' compute changes: module tree and the model's own forward stay as Hugging Face
built them. Weights are permuted in their own storage into the kernel's 16-row panels (no extra
memory); the state dict shows and loads the usual layout, and `restore_linears` undoes it. The
kernel is compiled on first use with PyTorch's C++ extension builder (a C++ compiler and ninja;
about a minute, once per machine, cached by PyTorch).

Modes (`load_model(kernel=...)`, `--kernel`, or the `SPECDECODE_KERNEL` environment variable):
  auto  use it for bfloat16 models when it builds, on an AVX2 CPU without AVX-512 and on an
        AVX-512 CPU with AVX-512 BF16 (its panels then run on `linear_avx512.cpp`); otherwise
        plain PyTorch (default). On AVX-512 without BF16 the kernel was never measured against
        PyTorch's own path (oneDNN), so there `on` must ask for it.
  on    use it, and fail with the reason when it cannot be used
  off   plain PyTorch

With the kernel, a model on SDPA attention also switches to `kernels/attention.py`'s attention
for few query tokens (`off` switches it back).

`quantize_linears` is separate and explicit (a draft spec's `:int8` or `:int4` suffix): it runs a
draft's linears on int8 copies of their weights, one scale per output row, or on 4-bit ones, a
scale and a min per row and group of 32 k. Only a drafter may be quantized: the target verifies
every drafted token, so the output stays the target's own, and the draft reads half (int8) or
about a third (4-bit) of the bytes per forward (its acceptance may change; measure it).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.kernels.attention import restore_attention, use_decode_attention

KERNEL_MODES = ("auto", "on", "off")
ENV = "SPECDECODE_KERNEL"
NAME = "bf16-avx2"  # what LoadedModel.kernel reports when the kernel is in use
INT8_NAME = "int8-avx2"  # ... and after quantize_linears
QUANT_NAMES = {8: INT8_NAME, 4: "int4-avx2"}  # by quantize_linears' bits
_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("linear_avx2.cpp", "linear_avx512.cpp", "draft_ops.cpp")
]
_HEADERS = [Path(__file__).with_name(name) for name in ("kernel_common.h", "int4_tile.h")]
_FLAG = "_specdecode_kernel"  # set on swapped modules
_QWEIGHT, _SCALE = "_specdecode_qweight", "_specdecode_scale"  # int8 buffers of quantized ones
_PANEL = 16  # output rows per packed panel (kPanel in the C++)
_PACKED = "_specdecode_packed"  # set where the weight's own storage holds its panels
_PANELS = "_specdecode_panels"  # buffer: the panels of a weight that cannot be packed in place
_HOOKS = "_specdecode_hooks"  # state-dict hook handles of a packed-in-place weight


BF16_DOT_ENV = "SPECDECODE_BF16_DOT"  # "0": bfloat16 panels on AVX2 FMAs even where AVX-512 BF16 is


def has_avx512_bf16() -> bool:
    """Whether the CPU reports AVX-512 BF16 (Linux /proc/cpuinfo; False where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


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
def _extension() -> Any:
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
    return bool(_extension().set_bf16_dot(on))


def use_int4_vnni(on: bool = True) -> bool:
    """Run the int4 tile on AVX-512 VNNI where the CPU has it (the default) or on AVX2: the same
    results bit for bit, for comparisons. Returns whether AVX-512 VNNI is in use now."""
    return bool(_extension().set_int4_vnni(on))


def kernel_description(kernel: str) -> str:
    """A loaded model's `kernel` for a report: with what its bfloat16 panels run on, if any."""
    return f"{kernel} (panels on {panels_isa()})" if kernel == NAME else kernel


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
    return int(_extension().bf16_dot_prefetch(elements or 0))


def panels_isa() -> str:
    """What bfloat16 panels run on now: "avx512-bf16" or "avx2-fma"."""
    return "avx512-bf16" if _extension().bf16_dot_on() else "avx2-fma"


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K even) -> panels [ceil(N / 16), K / 2, 16, 2]: the layout the kernel's
    `linear_packed` reads (16 output rows side by side, each row's weights at k and k + 1 in
    one 32-bit lane; rows past N are zeros)."""
    n, k = weight.shape
    pad = -n % _PANEL
    rows = F.pad(weight, (0, 0, 0, pad)) if pad else weight
    return rows.reshape(-1, _PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_panels` -> [n, k] (a copy; differentiable)."""
    return panels.reshape(-1, k // 2, _PANEL, 2).permute(0, 2, 1, 3).reshape(-1, k)[:n]


def pack_int8_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] -> panels [ceil(N / 16), K, 16] (`linear_int8_packed`; rows past N zero)."""
    n, k = q.shape
    pad = -n % _PANEL
    rows = F.pad(q, (0, 0, 0, pad)) if pad else q
    return rows.reshape(-1, _PANEL, k).permute(0, 2, 1).contiguous()


def int8_weights(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A `quantize_linears` layer's int8 weight [N, K] (usual layout, a copy) and scale [N]."""
    panels, scale = getattr(module, _QWEIGHT), getattr(module, _SCALE)
    n, k = module.weight.shape
    return panels.permute(0, 2, 1).reshape(-1, k)[:n], scale


def _panels(module: torch.nn.Linear) -> torch.Tensor | None:
    """The panels `module` runs on, or None (odd K: the row-major kernel)."""
    if getattr(module, _PACKED, False):
        return module.weight
    return module._buffers.get(_PANELS)


def row_major(module: torch.nn.Linear) -> torch.Tensor:
    """`module`'s weight [N, K] in its usual layout, also while it is packed in place (then a
    copy, differentiable with respect to the packed parameter)."""
    weight = module.weight
    if getattr(module, _PACKED, False):
        return unpack_panels(weight, *weight.shape)
    return weight


def _kernel_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
    ):
        # training, or inputs the kernel does not take
        return F.linear(x, row_major(self), self.bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [..., K] -> [M, K]
    panels = _panels(self)
    if panels is None:
        out = _extension().linear(flat, self.weight, self.bias)  # [M, N]
    else:
        out = _extension().linear_packed(flat, panels, self.weight.shape[0], self.bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _shared_storages(model: torch.nn.Module) -> set[int]:
    """Storages that more than one parameter or buffer name of `model` points at (tied
    weights: an output layer sharing the input embedding)."""
    seen: dict[int, int] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for _, tensor in named:
        ptr = tensor.untyped_storage().data_ptr()
        seen[ptr] = seen.get(ptr, 0) + 1
    return {ptr for ptr, count in seen.items() if count > 1}


def _pack(module: torch.nn.Linear, shared: set[int]) -> None:
    """Give `module` panels: in its weight's own storage (no extra memory) when nothing else
    uses that storage and N is a multiple of 16, else as a separate buffer (a tied output
    layer: its embedding still reads the usual layout). Odd K keeps the row-major kernel."""
    weight = module.weight
    n, k = weight.shape
    if k % 2:
        return
    with torch.no_grad():
        if n % _PANEL or weight.untyped_storage().data_ptr() in shared:
            # not persistent: the state dict keeps only the model's own weights
            module.register_buffer(_PANELS, pack_panels(weight), persistent=False)
            return
        weight.copy_(pack_panels(weight).view(n, k))
    setattr(module, _PACKED, True)
    # the state dict shows the usual layout, and loading one packs what it loads
    setattr(
        module,
        _HOOKS,
        (
            module._register_state_dict_hook(_state_dict_row_major),
            module._register_load_state_dict_pre_hook(_load_packed, with_module=True),
        ),
    )


def _state_dict_row_major(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "weight"
    if key in state_dict:
        state_dict[key] = row_major(module).detach()


def _load_packed(module, state_dict, prefix, *args) -> None:
    key = prefix + "weight"  # state_dict here is load_state_dict's own copy of the mapping
    if key in state_dict and state_dict[key].shape == module.weight.shape:
        state_dict[key] = pack_panels(state_dict[key]).view(module.weight.shape)


def _unpack(module: torch.nn.Linear) -> None:
    """Undo `_pack`: the weight in its usual layout again, the panels buffer dropped."""
    module._buffers.pop(_PANELS, None)
    if getattr(module, _PACKED, False):
        with torch.no_grad():
            module.weight.copy_(row_major(module))
        for handle in getattr(module, _HOOKS):
            handle.remove()
        delattr(module, _HOOKS)
        delattr(module, _PACKED)


def _eligible(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, torch.nn.Linear)
        and weight is not None
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.is_contiguous()
    )


def swap_linears(model: torch.nn.Module, panels: bool = True) -> int:
    """Run every eligible bfloat16 CPU `nn.Linear` of `model` on the kernel; returns how many.

    Weights with an even K are packed into the kernel's 16-row panels (`pack_panels`): in place
    where nothing else shares the storage (the state dict still shows, and loads, the usual
    layout; `row_major` gives it), as a separate copy for tied ones; `panels=False` keeps every
    weight row-major on the kernel's row tiles (for comparisons). Builds the kernel first
    (KernelUnavailable when it cannot). Idempotent.
    """
    _extension()
    count = 0
    shared = _shared_storages(model)
    for module in model.modules():
        if _eligible(module):
            if not getattr(module, _FLAG, False):
                if panels:
                    _pack(module, shared)
                module.forward = types.MethodType(_kernel_forward, module)
                setattr(module, _FLAG, True)
            count += 1
    return count


def restore_linears(model: torch.nn.Module) -> int:
    """Undo `swap_linears` and `quantize_linears`: plain PyTorch linears on the model's own
    weights again (the int8 copies are dropped); returns how many were restored."""
    count = 0
    for module in model.modules():
        if getattr(module, _FLAG, False):
            del module.forward  # the instance attribute; the class's forward shows again
            delattr(module, _FLAG)
            _unpack(module)
            for name in (_QWEIGHT, _SCALE, _Q4, _Q4_SCALE, _Q4_MIN):
                if name in module._buffers:
                    del module._buffers[name]
            count += 1
    return count


def quantize_int8(weight: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: weight [N, K] ~= q [N, K] int8 * scale [N, 1] float32.

    scale = max |row| / 127 (1 for an all-zero row); q = round(row / scale). Done `rows` rows at a
    time so a large embedding-sized weight needs no full float32 copy.
    """
    n = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(n, dtype=torch.float32, device=weight.device)
    for start in range(0, n, rows):
        part = weight[start : start + rows].float()  # [r, K]
        s = part.abs().amax(dim=1) / 127.0  # [r]
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[start : start + rows] = torch.round(part / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[start : start + rows] = s
    return q, scale


def _int8_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        # inputs the kernel does not take: the same quantized weights, through PyTorch
        q, scale = int8_weights(self)
        weight = (q.float() * scale[:, None]).to(x.dtype)
        return F.linear(x, weight, self.bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [..., K] -> [M, K]
    panels, scale = getattr(self, _QWEIGHT), getattr(self, _SCALE)
    out = _extension().linear_int8_packed(flat, panels, scale.shape[0], scale, self.bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


_INT4_GROUP = 32  # k per scale and min (kInt4Group in the C++)
_Q4, _Q4_SCALE, _Q4_MIN = "_specdecode_q4", "_specdecode_q4_scale", "_specdecode_q4_min"


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per row and group of 32 k: weight [N, K] ~= q * scale + min, q [N, K]
    uint8 in 0..15, scale and min [N, K / 32] float16 (min the group's, scale = (max - min) / 15,
    both rounded to float16 before q is chosen on their grid; scale 1 where the group is
    constant). Weights on such a grid (GGUF Q4_K sub-blocks) come back exactly where their group
    spans all 16 steps and the steps are float16 numbers."""
    n, k = weight.shape
    if k % _INT4_GROUP:
        raise ValueError(f"int4 needs K a multiple of {_INT4_GROUP} (got {k})")
    groups = weight.float().reshape(n, k // _INT4_GROUP, _INT4_GROUP)
    if groups.numel() and float(groups.abs().max()) > torch.finfo(torch.float16).max:
        raise ValueError("int4 needs weights within float16's range (its scales are float16)")
    low = groups.amin(-1).half()  # [N, G]
    scale = ((groups.amax(-1) - low.float()) / 15).half()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant (or tiny) groups
    q = torch.round((groups - low.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return q.to(torch.uint8).reshape(n, k), scale, low


def pack_int4_panels(
    q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_int4`'s output -> the layout `linear_int4_packed` reads: panels [P, K / 4, 32]
    uint8 (per panel of 16 rows and step of 4 k, byte 4r + j holds row r's weight at k = 4s + j
    in its low nibble and row r + 8's in its high one), scales and mins [P, K / 32, 16] float16;
    rows past N are zeros."""
    n, k = q.shape
    pad = -n % _PANEL
    q, scale, low = (F.pad(t, (0, 0, 0, pad)) if pad else t for t in (q, scale, low))
    rows = q.reshape(-1, 2, _PANEL // 2, k)  # [P, low | high nibble, 8, K]
    bytes_ = rows[:, 0] | (rows[:, 1] << 4)  # [P, 8, K]
    panels = bytes_.reshape(-1, _PANEL // 2, k // 4, 4).permute(0, 2, 1, 3)
    scales, mins = (
        t.reshape(-1, _PANEL, k // _INT4_GROUP).permute(0, 2, 1).contiguous() for t in (scale, low)
    )
    return panels.reshape(-1, k // 4, 32).contiguous(), scales, mins


def int4_weights(module: torch.nn.Linear) -> torch.Tensor:
    """A 4-bit layer's weight as it computes with it: [N, K] float32 (q * scale + min)."""
    panels, scales, mins = (getattr(module, name) for name in (_Q4, _Q4_SCALE, _Q4_MIN))
    n, k = module.weight.shape
    steps = panels.reshape(-1, k // 4, _PANEL // 2, 4).permute(0, 2, 1, 3).reshape(-1, 1, 8, k)
    q = torch.cat([steps & 0xF, steps >> 4], dim=1).reshape(-1, k).float()  # [N', K]
    scale, low = (t.permute(0, 2, 1).reshape(-1, k // _INT4_GROUP) for t in (scales, mins))
    groups = q.reshape(-1, k // _INT4_GROUP, _INT4_GROUP)
    return (groups * scale[..., None] + low[..., None]).reshape(-1, k)[:n]


def _int4_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        # inputs the kernel does not take: the same quantized weights, through PyTorch
        return F.linear(x, int4_weights(self).to(x.dtype), self.bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [..., K] -> [M, K]
    panels, scales, mins = (getattr(self, name) for name in (_Q4, _Q4_SCALE, _Q4_MIN))
    out = _extension().linear_int4_packed(
        flat, panels, self.weight.shape[0], scales, mins, self.bias
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _quantize_int4(module: torch.nn.Linear) -> None:
    panels, scales, mins = pack_int4_panels(*quantize_int4(row_major(module)))
    module._buffers.pop(_PANELS, None)  # a tied layer's panels: no longer read
    # not persistent: the state dict keeps only the model's own weights
    for name, tensor in ((_Q4, panels), (_Q4_SCALE, scales), (_Q4_MIN, mins)):
        module.register_buffer(name, tensor, persistent=False)
    module.forward = types.MethodType(_int4_forward, module)
    setattr(module, _FLAG, True)


def quantize_linears(model: torch.nn.Module, bits: int = 8) -> int:
    """Run every bfloat16 CPU `nn.Linear` of `model` on quantized copies of its weights for the
    AVX2 kernels; returns how many.

    bits=8: int8, one scale per output row (`quantize_int8`), in 16-row panels
    (`pack_int8_panels`; `int8_weights` gives them back). bits=4: 4-bit with a scale and a min per
    row and group of 32 k (`quantize_int4`, `pack_int4_panels`, `int4_weights`) where K is a
    multiple of 32, except an output layer tied to the embedding (the logits keep int8).

    For drafters only (a draft's output is verified; a target's would change). The bfloat16
    weights stay (embeddings may be tied to the output layer; `restore_linears` undoes it), so
    the model holds 1.5 (int8) or about 2.6 (4-bit) bytes per linear weight. Builds the kernel
    first (KernelUnavailable when it cannot). Idempotent: a quantized layer stays as it is.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8 (got {bits})")
    _extension()
    count = 0
    shared = _shared_storages(model)
    with torch.no_grad():
        for module in model.modules():
            if not _eligible(module):
                continue
            if _QWEIGHT not in module._buffers and _Q4 not in module._buffers:
                tied = module.weight.untyped_storage().data_ptr() in shared
                if bits == 4 and module.weight.shape[1] % _INT4_GROUP == 0 and not tied:
                    _quantize_int4(module)
                else:
                    _quantize_int8(module)
            count += 1
    return count


def _quantize_int8(module: torch.nn.Linear) -> None:
    q, scale = quantize_int8(row_major(module))
    module._buffers.pop(_PANELS, None)  # a tied layer's panels: no longer read
    # not persistent: the state dict keeps only the model's own weights
    module.register_buffer(_QWEIGHT, pack_int8_panels(q), persistent=False)
    module.register_buffer(_SCALE, scale, persistent=False)
    module.forward = types.MethodType(_int8_forward, module)
    setattr(module, _FLAG, True)


def direct_linear(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """What computes `module(x)` for x [M, K] contiguous bfloat16 on the CPU with the fewest
    Python steps: the kernel call itself when `module` runs on one of specdecode's kernels (no
    nn.Module call, no input checks or reshapes: about 20 us less per call, a fifth of a 0.5B
    draft's one-token forward), else the module.

    It holds the module's weights as they are now: make it again after quantizing the model,
    moving it or restoring its linears.
    """
    if not getattr(module, _FLAG, False):
        return module
    ext, bias, n = _extension(), module.bias, module.weight.shape[0]
    if _Q4 in module._buffers:
        panels, scales, mins = (module._buffers[name] for name in (_Q4, _Q4_SCALE, _Q4_MIN))
        return lambda x: ext.linear_int4_packed(x, panels, n, scales, mins, bias)
    if _QWEIGHT in module._buffers:
        panels, scale = module._buffers[_QWEIGHT], module._buffers[_SCALE]
        return lambda x: ext.linear_int8_packed(x, panels, n, scale, bias)
    panels = _panels(module)
    if panels is None:
        weight = module.weight
        return lambda x: ext.linear(x, weight, bias)
    return lambda x: ext.linear_packed(x, panels, n, bias)


def resolve_mode(mode: str | None) -> str:
    mode = (mode or os.environ.get(ENV) or "auto").lower()
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}: choose one of {', '.join(KERNEL_MODES)}")
    return mode


_warned: set[str] = set()


def apply_kernel(model: torch.nn.Module, mode: str | None = None) -> str:
    """Apply the kernel policy `mode` (None: $SPECDECODE_KERNEL, else auto) to a loaded model.

    Returns the kernel its linears now run on: "bf16-avx2" or "eager".
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
    capability = torch.backends.cpu.get_cpu_capability()
    if mode == "auto" and "AVX2" not in capability and not has_avx512_bf16():
        return "eager"  # AVX-512 machines without BF16 keep PyTorch's path; others cannot run it
    try:
        if not swap_linears(model):
            return "eager"
        use_decode_attention(model)  # the same switch: decoding's other hot spot on CPU
        return NAME
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
