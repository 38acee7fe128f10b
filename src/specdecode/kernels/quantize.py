"""A model's linears on int8 or 4-bit copies of their weights (`quantize_linears`).

A model spec's `:int8` or `:int4` suffix asks for it (models/quantized.py): int8 with one scale per
output row, or 4-bit with a scale and a min per row and group of 32 k. A GGUF-made target's Q6_K
tensors keep the file's 6-bit grid (`q6` panels: `pack_q6_panels`). A quantized draft reads half
(int8) or about a third (4-bit) of the bytes per forward (its acceptance may change; measure it)
and the output stays the target's own. A quantized target is a different model: speculation over
it reproduces the quantized target, not its bfloat16 original. `keep_weights=False` frees the
bfloat16 weights (what `load_model` does for targets and drafts alike).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.kernels.build import bf16_amx_on, extension, int4_vnni_on, int8_avx512_on
from specdecode.kernels.cpu import int4_name, int8_name
from specdecode.kernels.panels import (
    PANEL,
    PANELS_BUFFER,
    PREFILL_MARGIN,
    PREFILL_PROBE,
    best_ms,
    eligible,
    prefill_mode,
    row_major,
    set_forward,
    shared_storages,
)

_QWEIGHT, _SCALE = "_specdecode_qweight", "_specdecode_scale"  # int8 buffers of quantized ones
_INT4_GROUP = 32  # k per scale and min (kInt4Group in the C++)
# the 4-bit panels' buffers: weights, codes (sc, ml per group), steps (d, dl per block)
_Q4 = ("_specdecode_q4", "_specdecode_q4_codes", "_specdecode_q4_steps")
# the 6-bit panels' buffers: low 4 bits, top 2 bits, sc per 16 k, d per 256 k
_Q6 = ("_specdecode_q6", "_specdecode_q6_high", "_specdecode_q6_scale", "_specdecode_q6_d")
_MADV_DONTNEED = 4  # Linux's madvise advice: drop the pages
_Q6_SUB, _Q6_BLOCK = 16, 256  # k per sc, per d (kQ6Sub, kQ6Block in q6_tile.h)


def quant_name(bits: int) -> str:
    """The kernel name (LoadedModel.kernel) of a model quantize_linears(bits=...) leaves: the
    name says whether its tile runs on AVX-512 now (build.use_int8_avx512, use_int4_vnni)."""
    if bits == 8:
        return int8_name(int8_avx512_on())
    if bits == 4:
        return int4_name(int4_vnni_on())
    raise ValueError(f"quantized linears have 8 or 4 bits (got {bits!r})")


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


def pack_int8_panels(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] -> panels [ceil(N / 16), K, 16] (`linear_int8_packed`; rows past N zero)."""
    n, k = q.shape
    pad = -n % PANEL
    rows = F.pad(q, (0, 0, 0, pad)) if pad else q
    return rows.reshape(-1, PANEL, k).permute(0, 2, 1).contiguous()


def int8_weights(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A `quantize_linears` layer's int8 weight [N, K] (usual layout, a copy) and scale [N]."""
    panels, scale = getattr(module, _QWEIGHT), getattr(module, _SCALE)
    n, k = module.weight.shape
    return panels.permute(0, 2, 1).reshape(-1, k)[:n], scale


def _bias(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """The layer's bias in x's dtype (the PyTorch fall-backs: float32 inputs to a bfloat16 layer)."""
    return None if module.bias is None else module.bias.to(x.dtype)


# A 4-bit linear's codes (`quantize_int4`, models/gguf_int4.py's `decode_int4`): q [N, K] uint8
# in 0..15, sc [N, G] uint8, ml [N, G] int8 (G = K / 32 groups), d and dl [N, B] float16 (B blocks
# of groups: ceil(G / 8), or G for one per group). w = q * scale + min per group, scale = d sc and
# min = dl ml with d, dl those of the group's block.
Int4Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_INT4_BLOCK_SHIFT = 3  # 2^3 groups of 32 k share their steps d and dl: GGUF Q4_K's 256 k


def int4_shift(groups: int, blocks: int) -> int:
    """Groups per block of steps, as a shift (the kernel's `shift`): 0 where each group has its
    own steps (blocks == groups), else 3 (blocks == ceil(groups / 8))."""
    if blocks == groups:
        return 0
    if blocks == -(-groups // (1 << _INT4_BLOCK_SHIFT)):
        return _INT4_BLOCK_SHIFT
    raise ValueError(f"{blocks} blocks of steps for {groups} groups: expected {groups} or 1 per 8")


def _block_max(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """[N, G] non-negative per group -> [N, blocks]: the largest over each block of 8 groups (the
    last may be short: padded with zeros)."""
    pad = blocks * (1 << _INT4_BLOCK_SHIFT) - t.shape[1]
    return F.pad(t, (0, pad)).reshape(t.shape[0], blocks, -1).amax(-1)


def _per_group(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[N, B] per block of 8 groups -> [N, G]."""
    return t.repeat_interleave(1 << _INT4_BLOCK_SHIFT, dim=1)[:, :groups]


def quantize_int4(weight: torch.Tensor, rows: int = 4096) -> Int4Codes:
    """Asymmetric 4-bit per row and group of 32 k, on Q4_K's kind of grid: weight [N, K] ~=
    q * scale + min per group, q in 0..15, scale = d * sc and min = dl * ml with 8-bit codes
    (sc uint8, ml int8) per group and float16 steps d, dl per block of 8 groups (`Int4Codes`).

    Per group its min and step (max - min) / 15 are fitted, then coded on their block's steps
    (dl = max |min| / 127, d = max step / 255, rounded to nearest), and q is chosen on the coded
    grid. The codes cost about 0.03% of RMS error against float16 scales and mins per group
    (random and heavy-tailed weights), for 4.625 bits a weight read instead of 5. Rows are
    independent: done `rows` at a time, so a large output layer needs no full float32 copy."""
    weight = weight.detach()  # the codes are not differentiable
    n, k = weight.shape
    if n > rows:
        parts = [quantize_int4(weight[start : start + rows], rows) for start in range(0, n, rows)]
        joined = (torch.cat(codes) for codes in zip(*parts, strict=True))
        return tuple(joined)  # type: ignore[return-value]
    if k % _INT4_GROUP:
        raise ValueError(f"int4 needs K a multiple of {_INT4_GROUP} (got {k})")
    g = k // _INT4_GROUP
    groups = weight.float().reshape(n, g, _INT4_GROUP)
    if groups.numel() and float(groups.abs().max()) > torch.finfo(torch.float16).max:
        raise ValueError("int4 needs weights within float16's range (its steps are float16)")
    blocks = -(-g // (1 << _INT4_BLOCK_SHIFT))

    def step(top: torch.Tensor, codes: int) -> torch.Tensor:  # [N, B] float16, 1 where 0
        d = (top / codes).half()
        return torch.where(d > 0, d, torch.ones_like(d))

    low = groups.amin(-1)  # [N, G]
    dl = step(_block_max(low.abs(), blocks), 127)
    ml = torch.round(low / _per_group(dl.float(), g)).clamp_(-128, 127)
    low = ml * _per_group(dl.float(), g)  # the coded min
    scale = (groups.amax(-1) - low) / 15
    d = step(_block_max(scale, blocks), 255)
    sc = torch.round(scale / _per_group(d.float(), g)).clamp_(0, 255)
    scale = sc * _per_group(d.float(), g)  # the coded step (0: the group is its min)
    q = (groups - low[..., None]) / torch.where(scale > 0, scale, 1)[..., None]
    q = torch.round(q).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return q, sc.to(torch.uint8), ml.to(torch.int8), d, dl


def pack_int4_panels(
    q: torch.Tensor, sc: torch.Tensor, ml: torch.Tensor, d: torch.Tensor, dl: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Int4Codes` -> the layout `linear_int4_packed` reads: panels [P, K / 4, 32] uint8 (per
    panel of 16 rows and step of 4 k, byte 4r + j holds row r's weight at k = 4s + j in its low
    nibble and row r + 8's in its high one), codes [P, G, 32] uint8 (a group's 16 sc, then its
    16 ml) and steps [P, B, 32] float16 (a block's 16 d, then its 16 dl); rows past N zeros."""
    ml_bytes = ml.to(torch.int8).view(torch.uint8)  # the kernel reads them back as int8
    codes = torch.cat([_per_panel(sc.to(torch.uint8)), _per_panel(ml_bytes)], dim=2)
    steps = torch.cat([_per_panel(d.half()), _per_panel(dl.half())], dim=2)
    return _nibble_panels(q.to(torch.uint8)), codes, steps


def _padded(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [16 P, ...]: rows past N zeros."""
    pad = -t.shape[0] % PANEL
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def _per_panel(t: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, C] (a scale per group) -> [P, C, 16]: a panel's 16 rows side by side."""
    return _padded(t).reshape(-1, PANEL, t.shape[1]).permute(0, 2, 1).contiguous()


def _nibble_panels(q: torch.Tensor) -> torch.Tensor:
    """4-bit values q [N, K] uint8 -> [P, K / 4, 32]: byte 4r + j of step s holds row r at
    k = 4s + j (low nibble) and row r + 8 (high nibble)."""
    k = q.shape[1]
    rows = _padded(q).reshape(-1, 2, PANEL // 2, k)  # [P, low | high nibble, 8, K]
    bytes_ = rows[:, 0] | (rows[:, 1] << 4)  # [P, 8, K]
    panels = bytes_.reshape(-1, PANEL // 2, k // 4, 4).permute(0, 2, 1, 3)
    return panels.reshape(-1, k // 4, 32).contiguous()


def _nibbles(panels: torch.Tensor, k: int) -> torch.Tensor:
    """`_nibble_panels` undone: [P, K / 4, 32] -> [16 P, K] uint8."""
    steps = panels.reshape(-1, k // 4, PANEL // 2, 4).permute(0, 2, 1, 3).reshape(-1, 1, 8, k)
    return torch.cat([steps & 0xF, steps >> 4], dim=1).reshape(-1, k)


def _unpanel(t: torch.Tensor) -> torch.Tensor:
    """`_per_panel` undone: [P, C, 16] -> [16 P, C]."""
    return t.permute(0, 2, 1).reshape(-1, t.shape[1])


def int4_scale_min(codes: Int4Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's scale d * sc and min dl * ml [N, G] float32 (exact products)."""
    _, sc, ml, d, dl = codes
    g = sc.shape[1]
    repeat = 1 << int4_shift(g, d.shape[1])
    d, dl = (t.float().repeat_interleave(repeat, 1)[:, :g] for t in (d, dl))
    return sc.float() * d, ml.float() * dl


def dequantize_int4(codes: Int4Codes) -> torch.Tensor:
    """`Int4Codes` -> the weights [N, K] float32 they code, as the kernel computes with them."""
    q = codes[0]
    n, k = q.shape
    scale, low = int4_scale_min(codes)
    groups = q.float().reshape(n, k // _INT4_GROUP, _INT4_GROUP)
    return (groups * scale[..., None] + low[..., None]).reshape(n, k)


def int4_weights(module: torch.nn.Linear) -> torch.Tensor:
    """A 4-bit layer's weight as it computes with it: [N, K] float32 (q * scale + min)."""
    panels, codes, steps = (getattr(module, name) for name in _Q4)
    n, k = module.weight.shape
    sc, ml = _unpanel(codes[..., :PANEL]), _unpanel(codes[..., PANEL:]).view(torch.int8)
    d, dl = (_unpanel(t) for t in steps.split(PANEL, 2))
    return dequantize_int4((_nibbles(panels, k), sc, ml, d, dl))[:n]


def pack_q6_panels(
    q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q6_K's grid, w = d * sc * (q - 32) (q [N, K] uint8 in 0..63, sc [N, K / 16] int8,
    d [N, K / 256] float16) -> the layout `linear_q6_packed` reads: the low 4 bits as int4
    panels [P, K / 4, 32]; the top 2 bits [P, K / 8, 32] (byte 4r + j of step pair t, from bit
    0: rows r and r + 8 at k = 8t + j, then at k = 8t + 4 + j); sc [P, K / 16, 16] and
    d [P, K / 256, 16]. Rows past N are zeros."""
    n, k = q.shape
    if k % _Q6_BLOCK or sc.shape != (n, k // _Q6_SUB) or d.shape != (n, k // _Q6_BLOCK):
        raise ValueError(
            f"6-bit codes for a [{n}, {k}] linear are q [N, K] (K a multiple of 256), sc "
            f"[N, K / 16] and d [N, K / 256] (got {[tuple(t.shape) for t in (q, sc, d)]})"
        )
    q = q.to(torch.uint8)
    top = (_padded(q) >> 4).reshape(-1, 2, PANEL // 2, k // 8, 2, 4)  # [P, half, r, t, e, j]
    high = top[:, 0, :, :, 0] | top[:, 1, :, :, 0] << 2 | top[:, 0, :, :, 1] << 4
    high = high | top[:, 1, :, :, 1] << 6  # [P, r, t, j]
    high = high.permute(0, 2, 1, 3).reshape(-1, k // 8, 32).contiguous()
    return _nibble_panels(q & 0xF), high, _per_panel(sc.to(torch.int8)), _per_panel(d.half())


def q6_weights(module: torch.nn.Linear) -> torch.Tensor:
    """A 6-bit layer's weight as it computes with it: [N, K] float32 (d * sc * (q - 32))."""
    lo, high, sc, d = (getattr(module, name) for name in _Q6)
    n, k = module.weight.shape
    top = high.reshape(-1, k // 8, PANEL // 2, 4).permute(0, 2, 1, 3)  # [P, r, t, j]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1, 1, 1, 1)
    bits = (top[None] >> shifts) & 3  # [e * 2 + half, P, r, t, j]
    bits = bits.reshape(2, 2, *top.shape).permute(2, 1, 3, 4, 0, 5)  # [P, half, r, t, e, j]
    q = _nibbles(lo, k) | (bits.reshape(-1, k) << 4)  # [N', K]
    scale, step = (t.permute(0, 2, 1).reshape(-1, t.shape[1]).float() for t in (sc, d))
    w = scale.repeat_interleave(_Q6_SUB, 1) * step.repeat_interleave(_Q6_BLOCK, 1)
    return (w * (q.float() - 32))[:n]


def _quantized_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A quantized layer's forward: its kernel call (`quantized_call`) for bfloat16 CPU inputs,
    else the same quantized weights through PyTorch (float32 inputs, autograd)."""
    if (
        x.dtype != torch.bfloat16
        or x.device.type != "cpu"
        or (torch.is_grad_enabled() and x.requires_grad)
    ):
        return F.linear(x, quantized_weights(self).to(x.dtype), _bias(self, x))
    flat = x.reshape(-1, x.shape[-1]).contiguous()  # [..., K] -> [M, K]
    out = quantized_call(self, extension())(flat)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def quantized_weights(module: torch.nn.Linear) -> torch.Tensor:
    """A quantized layer's weight [N, K] float32 as it computes with it (int8, 4-bit or 6-bit)."""
    if _Q4[0] in module._buffers:
        return int4_weights(module)
    if _Q6[0] in module._buffers:
        return q6_weights(module)
    q, scale = int8_weights(module)
    return q.float() * scale[:, None]


def _quantize_q6(module: torch.nn.Linear, codes: tuple[torch.Tensor, ...]) -> None:
    n, k = module.weight.shape
    if codes[0].shape != (n, k):
        raise ValueError(f"6-bit codes for a [{n}, {k}] linear: q is {tuple(codes[0].shape)}")
    module._buffers.pop(PANELS_BUFFER, None)  # a tied layer's panels: no longer read
    for name, tensor in zip(_Q6, pack_q6_panels(*codes), strict=True):
        module.register_buffer(name, tensor, persistent=False)  # the state dict: own weights only
    set_forward(module, _quantized_forward)


def _quantize_int4(module: torch.nn.Linear, codes: Int4Codes | None = None) -> None:
    if codes is None:
        codes = quantize_int4(row_major(module))
    else:
        n, k = module.weight.shape
        g = k // _INT4_GROUP
        shapes = [tuple(t.shape) for t in codes]
        if k % _INT4_GROUP or len(codes) != 5 or shapes[:3] != [(n, k), (n, g), (n, g)]:
            raise ValueError(
                f"int4 codes for a [{n}, {k}] linear are q [N, K], sc and ml [N, K / 32], "
                f"d and dl [N, blocks] (got {shapes})"
            )
        if shapes[4] != shapes[3] or shapes[3][0] != n:
            raise ValueError(f"int4 steps d and dl must both be [{n}, blocks] (got {shapes[3:]})")
        int4_shift(g, shapes[3][1])  # a valid number of blocks
    module._buffers.pop(PANELS_BUFFER, None)  # a tied layer's panels: no longer read
    # not persistent: the state dict keeps only the model's own weights
    for name, tensor in zip(_Q4, pack_int4_panels(*codes), strict=True):
        module.register_buffer(name, tensor, persistent=False)
    set_forward(module, _quantized_forward)


def _quantize_int8(module: torch.nn.Linear) -> None:
    q, scale = quantize_int8(row_major(module))
    module._buffers.pop(PANELS_BUFFER, None)  # a tied layer's panels: no longer read
    # not persistent: the state dict keeps only the model's own weights
    module.register_buffer(_QWEIGHT, pack_int8_panels(q), persistent=False)
    module.register_buffer(_SCALE, scale, persistent=False)
    set_forward(module, _quantized_forward)


def quantize_linears(
    model: torch.nn.Module,
    bits: int = 8,
    keep_weights: bool = True,
    int4_codes: Mapping[str, Int4Codes] | None = None,
    tied_bits: int = 8,
    q6_codes: Mapping[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    release_pages: bool = False,
) -> int:
    """Run every bfloat16 CPU `nn.Linear` of `model` on quantized copies of its weights for the
    AVX2 kernels; returns how many.

    bits=8: int8, one scale per output row (`quantize_int8`), in 16-row panels
    (`pack_int8_panels`; `int8_weights` gives them back). bits=4: 4-bit with a coded scale and min
    per row and group of 32 k (`quantize_int4`, `pack_int4_panels`, `int4_weights`) where K is a
    multiple of 32, except an output layer tied to the embedding: it takes `tied_bits` (8 by
    default, so a target's logits keep int8; 4 for a draft, models/quantized.py, whose output
    layer is a large share of the bytes it reads).
    `int4_codes` (bits=4; module name -> its `Int4Codes`, e.g. a GGUF file's own,
    models/gguf_int4.py) gives those layers their 4-bit weights instead of
    `quantize_int4`, and `q6_codes` (module name -> (q [N, K] uint8 in 0..63, sc [N, K / 16]
    int8, d [N, K / 256] float16), a file's Q6_K tensors) others their 6-bit ones
    (`pack_q6_panels`); every other layer then runs on int8 (their source grid is not 4-bit).

    With `keep_weights` (a draft in training) the bfloat16 weights stay (`restore_linears`
    undoes it), so the model holds 1.5 (int8) or about 2.6 (4-bit) bytes per linear weight.
    `keep_weights=False` (targets and drafts that `load_model` quantizes) frees the bfloat16
    weight of every quantized layer whose storage nothing else shares (`free_weight`; an output
    layer tied to the embedding keeps it, the embedding reads it): the layers keep their shapes
    and compute as before, but cannot be restored; `release_pages` also hands their memory pages
    back at once (`free_weight`: only for a model whose tensors nothing outside it shares, as
    `load_model`'s own). Builds the kernel first (KernelUnavailable when it cannot).
    Idempotent: a quantized layer stays as it is (its weight is freed if asked now).
    `quant_name(bits)` is the kernel name of the model it leaves.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8 (got {bits})")
    if (int4_codes is not None or q6_codes is not None) and bits != 4:
        raise ValueError(f"a file's int4 / q6 codes need bits=4 (got {bits})")
    if q6_codes is not None and int4_codes is None:
        raise ValueError("q6_codes come with the file's int4_codes (models/gguf_int4.py)")
    if tied_bits not in (4, 8):
        raise ValueError(f"tied_bits must be 4 or 8 (got {tied_bits})")
    extension()
    count = 0
    shared = shared_storages(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if is_quantized(module):
                pass  # as it is (a freed weight is on the meta device: not `eligible`)
            elif not eligible(module):
                continue
            else:
                tied = module.weight.untyped_storage().data_ptr() in shared
                if int4_codes is not None:
                    if name in int4_codes:
                        _quantize_int4(module, int4_codes[name])
                    elif q6_codes is not None and name in q6_codes:
                        _quantize_q6(module, q6_codes[name])
                    else:
                        _quantize_int8(module)
                elif (
                    bits == 4
                    and module.weight.shape[1] % _INT4_GROUP == 0
                    and (tied_bits == 4 or not tied)
                ):
                    _quantize_int4(module)
                else:
                    _quantize_int8(module)
            if not keep_weights and _untied(module.weight, shared):
                free_weight(module, release_pages)  # a tied weight stays: its embedding reads it
            count += 1
    return count


def _untied(weight: torch.Tensor, shared: set[int]) -> bool:
    """A weight with storage that no other parameter or buffer shares (not freed already)."""
    return not weight.is_meta and weight.untyped_storage().data_ptr() not in shared


def is_quantized(module: torch.nn.Module) -> bool:
    return any(name in module._buffers for name in (_QWEIGHT, _Q4[0], _Q6[0]))


def free_weight(module: torch.nn.Linear, release_pages: bool = False) -> None:
    """Drop a quantized layer's bfloat16 weight: it becomes a tensor of the same shape and dtype
    on the meta device (no storage), so whatever reads its shape still works, whatever would
    compute with it fails loudly, and the layer computes from its quantized copies (the kernel,
    or the PyTorch fall-back from `int4_weights` / `int8_weights`). `release_pages`: its pages
    are handed back to the system now (`drop_pages`), for a weight nothing else can read (not
    one a `prune.shared_copy` shares with its reference)."""
    if not is_quantized(module):
        raise ValueError("only a quantized layer's weight can be freed (it computes without it)")
    weight = module.weight
    if not weight.is_meta:
        module.weight = torch.nn.Parameter(weight.to("meta"), requires_grad=False)
        if release_pages:
            drop_pages(weight)


def drop_pages(weight: torch.Tensor) -> None:
    """Hand the memory pages wholly inside `weight`'s bytes back to the system now (Linux's
    madvise MADV_DONTNEED; elsewhere, or for a tensor not contiguous, nothing is done).

    A weight loaded from safetensors is a view of the file, which transformers maps into memory:
    its pages, once read, stay in the process while any other view of the file lives (the
    embedding does), freed or not. Callers pass only a tensor whose bytes nothing else reads
    (`free_weight(release_pages=True)` for a model just loaded; a parameter `own_memory` has
    copied): a file's pages would be read from the file again if touched, anonymous ones would
    come back as zeros. Only its own bytes go, never the rest of a storage it shares."""
    if weight.device.type == "cpu" and weight.is_contiguous():
        drop_range(weight.data_ptr(), weight.numel() * weight.element_size())


def drop_range(address: int, nbytes: int) -> None:
    """madvise(MADV_DONTNEED) over the whole pages inside [address, address + nbytes), on Linux
    and for 16 pages or more (`drop_pages`; a memory-mapped file's bytes once read)."""
    if sys.platform != "linux":
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-address // page) * page  # the first whole page inside
    end = (address + nbytes) // page * page
    if end - start >= 16 * page:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library already in the process (one handle for every weight a load drops)."""
    return ctypes.CDLL(None, use_errno=True)


def weight_freed(module: torch.nn.Module) -> bool:
    """Whether `module`'s weight was freed by `free_weight` (quantize_linears(keep_weights=False))."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.is_meta


def drop_quantized(module: torch.nn.Module) -> None:
    """Drop a quantized layer's int8, 4-bit or 6-bit copies (its bfloat16 weight stays)."""
    for name in (_QWEIGHT, _SCALE, *_Q4, *_Q6):
        if name in module._buffers:
            del module._buffers[name]


def quantized_call(
    module: torch.nn.Linear, ext: Any
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A quantized layer's kernel call for x [M, K] contiguous bfloat16 (the extension's
    `LinearOp`, which the native layer loop calls too), or None when `module` is not quantized
    (cpu_linear.direct_linear)."""
    bias, n = module.bias, module.weight.shape[0]
    if _Q4[0] in module._buffers:
        panels, codes, steps = (module._buffers[name] for name in _Q4)
        shift = int4_shift(codes.shape[1], steps.shape[1])
        return ext.LinearOp("int4", [panels, codes, steps], n, shift, bias)
    if _QWEIGHT in module._buffers:
        panels, scale = module._buffers[_QWEIGHT], module._buffers[_SCALE]
        return ext.LinearOp("int8", [panels, scale], n, 0, bias)
    if _Q6[0] in module._buffers:
        return ext.LinearOp("q6", [module._buffers[name] for name in _Q6], n, 0, bias)
    return None


def amx_prefill_call(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A prefill's product for a 4-bit or 6-bit linear, x [M, K] bfloat16 with M past the
    verification rows (the lean forward's `_prefill`): its panels unpacked to bfloat16 per pair
    and run on AMX bfloat16 tiles over every row (`linear_int4_prefill`, `linear_q6_prefill`;
    bfloat16 activations, so not the tiles' bits: a prefill only), where this machine has them
    and that is the faster here (`prefill_on_amx`). None otherwise, and for int8 layers: their
    tiles serve."""
    if not any(name in module._buffers for name in (_Q4[0], _Q6[0])) or not prefill_on_amx():
        return None
    bias, n, ext = module.bias, module.weight.shape[0], extension()
    if _Q6[0] in module._buffers:
        lo, high, sc, d = (module._buffers[name] for name in _Q6)
        return lambda x: ext.linear_q6_prefill(x, lo, high, sc, d, n, bias)
    panels, codes, steps = (module._buffers[name] for name in _Q4)
    shift = int4_shift(codes.shape[1], steps.shape[1])
    return lambda x: ext.linear_int4_prefill(x, panels, n, codes, steps, shift, bias)


def prefill_on_amx() -> bool:
    """Whether a prefill's 4-bit and 6-bit linears run on AMX bfloat16 tiles
    (`amx_prefill_call`): never without them (or with `use_bf16_amx(False)`); else
    $SPECDECODE_PREFILL_LINEARS decides, as for bfloat16 linears (kernel: the tiles, torch:
    AMX), and auto measures once per process on a 4-bit product (`_amx_beats_int4`; the 6-bit
    tile does more per weight, so it follows)."""
    if not bf16_amx_on():
        return False
    mode = prefill_mode()
    return mode == "torch" if mode != "auto" else _amx_beats_int4()


@functools.cache
def _amx_beats_int4() -> bool:
    """The 4-bit tile against its panels unpacked to bfloat16 on AMX tiles, over PREFILL_PROBE's
    rows and shape (random weights), the best of three each: True where AMX is at least
    PREFILL_MARGIN times as fast."""
    rows, k, n = PREFILL_PROBE
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    _quantize_int4(layer)
    panels, codes, steps = (layer._buffers[name] for name in _Q4)
    shift = int4_shift(codes.shape[1], steps.shape[1])
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ext = extension()
    with torch.inference_mode():
        tile = best_ms(lambda: ext.linear_int4_packed(x, panels, n, codes, steps, shift, None))
        amx = best_ms(lambda: ext.linear_int4_prefill(x, panels, n, codes, steps, shift, None))
    return amx * PREFILL_MARGIN <= tile
