"""How close `MODEL:int4` of a cached preset now is to its GGUF (models/gguf_int4.py).

`:int4` of a GGUF-made model takes the file's own 4-bit codes (Q4_K, Q4_1, Q4_0) and 6-bit ones
(Q6_K), and runs the file's other linears (Q5_0, Q8_0, ...) on int8 per row of the bfloat16
preset. Per tensor
kind and GGUF type this compares those weights, as the kernel computes with them (float32), with
the GGUF's own values (gguf-py's dequantize):

- `decoded = gguf`: for 4-bit tensors, whether `decode_float` (our decoding) equals gguf-py's
  values bit for bit, every weight; for Q6_K, whether `decode_q6`'s d * sc * (q - 32) does;
- `preset = bf16(gguf)`: whether the preset's weights are the GGUF values rounded to bfloat16
  (the module mapping, and for llama files the q / k permutation, checked on every row);
- `:int4 as`: 4-bit or 6-bit (the file's codes) or int8 (per row);
- `exact groups`: the groups of 32 where `:int4` equals the GGUF values, all 32;
- `max err / step`: for 4-bit, the largest |int4 - GGUF| over the group's step d*sc (groups
  with a step, sc > 0);
- `rel. err`: ||int4 - GGUF|| / ||GGUF|| over the kind.

Uses the GGUF in `fetch.gguf_dir()` (`specdecode models gguf NAME` rebuilds it). Not a timing
benchmark. Run alone, one preset at a time:

    nice -n 10 python lab/probes/gguf_int4.py qwen2.5-coder-1.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import safe_open
from tqdm import tqdm

from specdecode.kernels.quantize import dequantize_int4, int4_scale_min, quantize_int8
from specdecode.models import fetch, presets
from specdecode.models.gguf_int4 import (
    _PERMUTED,
    _hf_rows,
    _module_name,
    decode_float,
    decode_int4,
    decode_q6,
)

ROWS = 2048  # rows per step (everything here is per row)
FOUR_BIT = ("Q4_K", "Q4_1", "Q4_0")


@dataclass
class Tally:
    tensors: int = 0
    weights: int = 0
    groups: int = 0
    exact: int = 0
    decoded_equal: bool = True
    preset_equal: bool = True
    max_step_err: float = 0.0
    err2: float = 0.0
    ref2: float = 0.0


def measure(name: str) -> dict[tuple[str, str], Tally]:
    preset = presets.get_preset(name)
    path = fetch.gguf_dir() / preset.gguf_filename
    folder = fetch.cached_path(name)
    if folder is None or not path.is_file():
        raise SystemExit(f"needs the cached preset and `specdecode models gguf {name}` first")
    config = json.loads((folder / "config.json").read_text())
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    tallies: dict[tuple[str, str], Tally] = defaultdict(Tally)

    class Config:  # the two fields _hf_rows reads
        num_attention_heads = config["num_attention_heads"]
        num_key_value_heads = config.get("num_key_value_heads")

    with safe_open(folder / "model.safetensors", framework="pt") as weights:
        for tensor in tqdm(reader.tensors, desc=name, unit="tensor", file=sys.stderr):
            module = _module_name(tensor.name, "model.layers")
            if module is None:
                continue  # embedding, norms, biases: not linears :int4 quantizes
            qtype = tensor.tensor_type.name
            tally = tallies[(module.split(".")[-1], qtype)]
            tally.tensors += 1
            full = weights.get_tensor(f"{module}.weight")  # [N, K] bfloat16
            order = _hf_rows(module, full.shape[0], Config, arch in _PERMUTED)
            if order is not None:  # the preset's rows in the file's order
                full = full[torch.argsort(order)]
            for start in range(0, full.shape[0], ROWS):
                raw = np.asarray(tensor.data[start : start + ROWS])
                gguf = torch.from_numpy(dequantize(raw, tensor.tensor_type)).float()  # [R, K]
                rows = full[start : start + ROWS]
                tally.preset_equal &= torch.equal(rows, gguf.bfloat16())
                if qtype in FOUR_BIT:
                    tally.decoded_equal &= torch.equal(decode_float(raw, qtype), gguf)
                    codes = decode_int4(raw, qtype)
                    out = dequantize_int4(codes)
                    err = (out - gguf).abs().reshape(out.shape[0], -1, 32)
                    step = int4_scale_min(codes)[0][..., None]  # groups of step 0: min only
                    per_step = (err / step.clamp_min(1e-30))[(step > 0).expand_as(err)]
                    tally.max_step_err = max(tally.max_step_err, float(per_step.max()))
                    tally.groups += err.shape[0] * err.shape[1]
                    tally.exact += int((err == 0).all(-1).sum())
                    diff = err
                elif qtype == "Q6_K":
                    q, sc, d = decode_q6(raw)
                    scale = sc.float().repeat_interleave(16, 1) * d.float().repeat_interleave(
                        256, 1
                    )
                    diff = scale * (q.float() - 32) - gguf
                    tally.decoded_equal &= not bool(diff.any())
                else:
                    q8, s8 = quantize_int8(rows)
                    diff = q8.float() * s8[:, None] - gguf
                tally.weights += gguf.numel()
                tally.err2 += float(diff.double().square().sum())
                tally.ref2 += float(gguf.double().square().sum())
    return tallies


def render(name: str, tallies: dict[tuple[str, str], Tally]) -> str:
    header = [
        "tensor kind", "GGUF type", "tensors", "share of linear weights", "decoded = gguf",
        "preset = bf16(gguf)", ":int4 as", "exact groups", "max err / step", "rel. err",
    ]  # fmt: skip
    total = sum(t.weights for t in tallies.values())
    lines = [f"#### {name}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (kind, qtype), t in sorted(tallies.items()):
        four = qtype in FOUR_BIT
        cells = [
            kind, qtype, str(t.tensors), f"{t.weights / total:.1%}",
            ("yes" if t.decoded_equal else "NO") if four or qtype == "Q6_K" else "-",
            "yes" if t.preset_equal else "NO",
            "4-bit (file's codes)" if four else "6-bit (file's)" if qtype == "Q6_K" else "int8",
            f"{t.exact / t.groups:.1%}" if four else "-",
            f"{t.max_step_err:.1e}" if four else "-", f"{(t.err2 / t.ref2) ** 0.5:.1e}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    four_bit = sum(t.weights for (_, q), t in tallies.items() if q in FOUR_BIT)
    lines += ["", f"4-bit from the file's codes: {four_bit / total:.1%} of the linear weights"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=list(presets.PRESETS))
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared machine; not a timing run
    print(render(args.preset, measure(args.preset)))


if __name__ == "__main__":
    main()
