"""bfloat16 weights in the kernel's 16-row panels, and which linears run on a kernel.

Weights with an even K are permuted in their own storage into panels (no extra memory) where
nothing else shares that storage, else copied into a separate buffer (a tied output layer: its
embedding still reads the usual layout). The state dict shows and loads the usual layout
(`row_major` gives it); `unpack` undoes it.
"""

from __future__ import annotations

import functools
import os
import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.kernels.build import extension, panels_isa

PANEL = 16  # output rows per packed panel (kPanel in the C++)
PANELS_BUFFER = "_specdecode_panels"  # the panels of a weight that cannot be packed in place
_FLAG = "_specdecode_kernel"  # set on modules that run on a kernel
_PACKED = "_specdecode_packed"  # set where the weight's own storage holds its panels
_HOOKS = "_specdecode_hooks"  # state-dict hook handles of a packed-in-place weight
_PAIR = {2: torch.int32, 4: torch.int64}  # element size -> a number as wide as two elements
# who computes a prefill's many rows of a bfloat16 linear on the kernel: auto (measured, see
# prefill_on_torch), kernel (its panels), torch (PyTorch's product on the unpacked weight)
PREFILL_ENV = "SPECDECODE_PREFILL_LINEARS"
PREFILL_MODES = ("auto", "kernel", "torch")
PREFILL_PROBE = (256, 2048, 4096)  # rows, K, N of the product prefill_on_torch times
PREFILL_MARGIN = 1.25  # PyTorch must be this many times as fast to be chosen
# kernel_forward (Hugging Face's forward) hands a product of more rows than this, a prefill's, to
# PyTorch where prefill_on_torch; the lean forward draws its own line (lean.VERIFY_TOKENS)
PREFILL_ROWS = 128


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (K even) -> panels [ceil(N / 16), K / 2, 16, 2]: the layout the kernel's
    `linear_packed` reads (16 output rows side by side, each row's weights at k and k + 1 in
    one 32-bit lane; rows past N are zeros)."""
    n, k = weight.shape
    pad = -n % PANEL
    rows = F.pad(weight, (0, 0, 0, pad)) if pad else weight
    pair = _PAIR.get(weight.element_size())
    if pair is None:
        return rows.reshape(-1, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    # each pair (k, k + 1) as one number twice as wide, so the copy moves whole lanes: several
    # times faster than permuting the pairs' halves, and the same bytes
    lanes = rows.contiguous().view(pair).view(-1, PANEL, k // 2)  # [N / 16, 16, K / 2]
    panels = lanes.transpose(1, 2).contiguous()  # [N / 16, K / 2, 16]
    return panels.view(weight.dtype).view(-1, k // 2, PANEL, 2)


def unpack_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack_panels` -> [n, k] (a copy; differentiable)."""
    pair = _PAIR.get(panels.element_size())
    if pair is None or (panels.requires_grad and torch.is_grad_enabled()):
        return panels.reshape(-1, k // 2, PANEL, 2).permute(0, 2, 1, 3).reshape(-1, k)[:n]
    # whole lanes, as pack_panels moves them (a dtype view has no gradient)
    lanes = panels.reshape(-1, k // 2, PANEL, 2).view(pair).reshape(-1, k // 2, PANEL)
    rows = lanes.transpose(1, 2).contiguous()  # [N / 16, 16, K / 2]
    return rows.reshape(-1).view(panels.dtype).reshape(-1, k)[:n]


def module_panels(module: torch.nn.Linear) -> torch.Tensor | None:
    """The panels `module` runs on, or None (odd K: the row-major kernel)."""
    if packed_in_place(module):
        return module.weight
    return module._buffers.get(PANELS_BUFFER)


def row_major(module: torch.nn.Linear) -> torch.Tensor:
    """`module`'s weight [N, K] in its usual layout, also while it is packed in place (then a
    copy, differentiable with respect to the packed parameter)."""
    weight = module.weight
    if packed_in_place(module):
        return unpack_panels(weight, *weight.shape)
    return weight


def kernel_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A bfloat16 linear's forward on the kernel (its panels, or row-major for an odd K)."""
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
    ):
        # training, or inputs the kernel does not take
        return F.linear(x, row_major(self), self.bias)
    if x.numel() > PREFILL_ROWS * x.shape[-1] and prefill_on_torch():  # more than 128 rows
        return F.linear(x, row_major(self), self.bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [..., K] -> [M, K]
    panels = module_panels(self)
    if panels is None:
        out = extension().linear(flat, self.weight, self.bias)  # [M, N]
    else:
        out = extension().linear_packed(flat, panels, self.weight.shape[0], self.bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def panels_call(module: torch.nn.Linear, ext: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module`'s bfloat16 kernel call for x [M, K] contiguous bfloat16 (the extension's
    `LinearOp`; cpu_linear.direct_linear)."""
    bias, n = module.bias, module.weight.shape[0]
    panels = module_panels(module)
    if panels is None:
        return ext.LinearOp("rows", [module.weight], n, 0, bias)
    return ext.LinearOp("panels", [panels], n, 0, bias)


def shared_storages(model: torch.nn.Module) -> set[int]:
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


def pack(module: torch.nn.Linear, shared: set[int]) -> None:
    """Give `module` panels: in its weight's own storage (no extra memory) when nothing else
    uses that storage and N is a multiple of 16, else as a separate buffer (a tied output
    layer: its embedding still reads the usual layout). Odd K keeps the row-major kernel.

    (A weight loaded from safetensors is a view of the file, mapped copy-on-write: written in
    place, each page becomes the process's own in place of the file's, so the peak memory stays
    the model's; a new tensor would hold a second copy while the file's pages stay mapped.)"""
    weight = module.weight
    n, k = weight.shape
    if k % 2:
        return
    with torch.no_grad():
        if n % PANEL or weight.untyped_storage().data_ptr() in shared:
            # not persistent: the state dict keeps only the model's own weights
            module.register_buffer(PANELS_BUFFER, pack_panels(weight), persistent=False)
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


def packed_in_place(module: torch.nn.Module) -> bool:
    """Whether `module`'s weight holds its panels (`pack`)."""
    return getattr(module, _PACKED, False)


def unpack(module: torch.nn.Linear) -> None:
    """Undo `pack`: the weight in its usual layout again, the panels buffer dropped."""
    module._buffers.pop(PANELS_BUFFER, None)
    if packed_in_place(module):
        with torch.no_grad():
            module.weight.copy_(row_major(module))
        for handle in getattr(module, _HOOKS):
            handle.remove()
        delattr(module, _HOOKS)
        delattr(module, _PACKED)


def eligible(module: torch.nn.Module) -> bool:
    """Whether `module` is a linear the kernels can run: bfloat16, contiguous, on the CPU."""
    weight = getattr(module, "weight", None)
    return (
        isinstance(module, torch.nn.Linear)
        and weight is not None
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.is_contiguous()
    )


def on_kernel(module: torch.nn.Module) -> bool:
    """Whether `module` runs on one of specdecode's kernels (swap_linears, quantize_linears)."""
    return getattr(module, _FLAG, False)


def set_forward(module: torch.nn.Module, forward: Callable[..., torch.Tensor]) -> None:
    """Run `module` on `forward(module, x)`, one of the kernels' forwards, from now on."""
    module.forward = types.MethodType(forward, module)
    setattr(module, _FLAG, True)


def clear_forward(module: torch.nn.Module) -> None:
    """Undo `set_forward`: the module's class forward again."""
    del module.forward  # the instance attribute; the class's forward shows again
    delattr(module, _FLAG)


def prefill_mode() -> str:
    """$SPECDECODE_PREFILL_LINEARS, checked: auto (the default), kernel or torch."""
    mode = (os.environ.get(PREFILL_ENV) or "auto").lower()
    if mode not in PREFILL_MODES:
        raise ValueError(f"{PREFILL_ENV} must be one of {', '.join(PREFILL_MODES)} (got {mode!r})")
    return mode


def prefill_on_torch() -> bool:
    """Whether a prefill's bfloat16 linears run on PyTorch's product rather than the panels:
    $SPECDECODE_PREFILL_LINEARS = kernel / torch decides; auto (default) measures once per
    process and panels path (`_torch_beats_panels`). On AVX2 and
    AVX-512 BF16 the panels' work grows with every row, while PyTorch's product (oneDNN) tiles
    many rows; on AMX tiles the panels tile them too (docs/results.md)."""
    mode = prefill_mode()
    return mode == "torch" if mode != "auto" else _torch_beats_panels(panels_isa())


def best_ms(fn: Callable[[], Any], rounds: int = 3) -> float:
    """The best of `rounds` timed calls of fn, in ms, after one untimed call (a once-per-process
    choice between two products of the same shape, measured on this machine)."""
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


@functools.cache
def _torch_beats_panels(isa: str) -> bool:
    """PyTorch's product with the weight unpacked for the call (as `prefill_linear` runs it)
    against the kernel's panels on `isa` (what they run on now: the answer is kept per path,
    so switching the path measures again), over PREFILL_PROBE's rows, the best of three each:
    True where PyTorch is at least PREFILL_MARGIN times as fast."""
    rows, k, n = PREFILL_PROBE
    gen = torch.Generator().manual_seed(0)
    panels = pack_panels((torch.randn(n, k, generator=gen) * 0.02).bfloat16())
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ext = extension()
    with torch.inference_mode():
        on_panels = best_ms(lambda: ext.linear_packed(x, panels, n, None))
        on_torch = best_ms(lambda: F.linear(x, unpack_panels(panels, n, k)))
    return on_torch * PREFILL_MARGIN <= on_panels
