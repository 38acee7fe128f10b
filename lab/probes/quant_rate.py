"""The quantized linears against the machine's read bandwidth and PyTorch's own CPU kernels.

    python lab/probes/quant_rate.py
    python lab/probes/quant_rate.py --shapes 8960x1536,1536x8960,1536x1536 --rows 1,4,12,16

For each layer shape (out x in) it runs `--copies` copies one after another, so the weights come
from memory as in a model's forward, over 1..n rows of bfloat16 activations, and prints per
kernel: ms per pass, the weight bytes read per second at one row (against the bandwidth the
machine reaches reading a large buffer, measured first in the same process), and v(n) = ms over
n rows / ms over one. Kernels, in alternating rounds:

  int4        specdecode's 4-bit linear (groups of 32, 8-bit scale and min codes under float16
              steps per 256 k: `quantize_linears`)
  int4-avx2   the same with its tile on AVX2 where the CPU has AVX-512 VNNI (the same results)
  int8        specdecode's int8 linear (one scale per output row)
  int8-avx2   the same with its tile on AVX2 where the CPU has AVX-512 F (the same results)
  q6          specdecode's 6-bit linear (GGUF Q6_K's grid, a GGUF-made int4 target's Q6_K
              tensors: the weight's codes random here, the time does not depend on them)
  q6-avx2     the same with its tile on AVX2 where the CPU has AVX-512 VNNI (the same results)
  torch-int4  torch.ops.aten._weight_int4pack_mm_for_cpu (groups of 32, bfloat16 scale and zero)
  torch-int8  torch._weight_int8pack_mm (one scale per output row)

Bytes read per weight: int4 4 + the 8-bit scale and min codes per 32 + the float16 steps per
256 (4.625 bits), int8 8 (+ a
float32 scale per row), q6 6 + an int8 sc per 16 + a float16 d per 256 (6.56 bits),
torch-int4 4 + its bfloat16 scale and zero per 32 (5 bits).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks
from benchmarks.kernel_rate import seconds
from specdecode.kernels.build import extension
from specdecode.kernels.cpu_linear import swap_linears
from specdecode.kernels.quantize import _quantize_q6, quantize_linears

GROUP = 32


def read_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a full read of a large buffer reaches (int64 sum, all threads)."""
    buffer = torch.ones(int(gigabytes * 1e9) // 8, dtype=torch.int64)
    buffer.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 8 / min(times)


def ours(weight: torch.Tensor, bits: int):
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(torch.bfloat16)
    layer.weight.data.copy_(weight)
    swap_linears(layer)
    quantize_linears(layer, bits=bits)
    return layer


def q6(weight: torch.Tensor):
    n, k = weight.shape
    layer = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8)
    sc = torch.randint(-128, 128, (n, k // 16)).to(torch.int8)
    _quantize_q6(layer, (q, sc, torch.full((n, k // 256), 1e-4).half()))
    return layer


def torch_int4(weight: torch.Tensor):
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).int(), 2)
    # PyTorch's zero point: w = (q - 8) * scale + zero, so zero = low + 8 * scale
    scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    scales_zeros = scales_zeros.to(torch.bfloat16)  # [K / 32, N, 2]
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)


def torch_int8(weight: torch.Tensor):
    scale = weight.float().abs().amax(1) / 127
    q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    scale = scale.to(torch.bfloat16)
    return lambda x: torch._weight_int8pack_mm(x, q, scale)


def ours_on_tile(weight: torch.Tensor, bits: int, avx512: bool):
    """Our `bits`-bit linear with its tile switched per call: AVX-512 (VNNI for 4 and 6 bits,
    F for 8) where the CPU has it (`avx512`), else AVX2 (the same results)."""
    layer = q6(weight) if bits == 6 else ours(weight, bits)
    ext = extension()
    switch = ext.set_int8_avx512 if bits == 8 else ext.set_int4_vnni

    def call(x: torch.Tensor) -> torch.Tensor:
        switch(avx512)
        return layer(x)

    return call


# bits read per weight: int4 4 + an 8-bit sc and ml per 32 + a float16 d and dl per 256 (until
# 2026-12-03 this said 4.5 + 1 for the float16 scale and min per 32, which were 5 bits: the int4
# GB/s printed before then are 10% too high)
INT4_BITS = 4.0 + 16 / GROUP + 32 / 256
Q6_BITS = 6.0 + 8 / 16 + 16 / 256

KERNELS = {
    "int4": (lambda w: ours_on_tile(w, 4, True), INT4_BITS),
    "int4-avx2": (lambda w: ours_on_tile(w, 4, False), INT4_BITS),
    "int8": (lambda w: ours_on_tile(w, 8, True), 8.0),
    "int8-avx2": (lambda w: ours_on_tile(w, 8, False), 8.0),
    "q6": (lambda w: ours_on_tile(w, 6, True), Q6_BITS),
    "q6-avx2": (lambda w: ours_on_tile(w, 6, False), Q6_BITS),
    "torch-int4": (torch_int4, 4.0 + 32 / GROUP),
    "torch-int8": (torch_int8, 8.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8960x1536,1536x8960,1536x1536")
    parser.add_argument("--rows", default="1,4,12,16")
    parser.add_argument("--kernels", default="int4,torch-int4,int8,torch-int8")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    rows = [int(r) for r in args.rows.split(",")]
    kernels = args.kernels.split(",")
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")
    print(
        "| shape | kernel | "
        + " | ".join(f"{r} rows ms" for r in rows)
        + " | GB/s at 1 row | "
        + " | ".join(f"v({r})" for r in rows[1:])
        + " |"
    )
    print("|---" * (3 + 2 * len(rows)) + "|")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weights = [(torch.randn(n, k) / k**0.5).to(torch.bfloat16) for _ in range(args.copies)]
        calls = {name: [KERNELS[name][0](w) for w in weights] for name in kernels}
        inputs = {r: torch.randn(r, k).to(torch.bfloat16) for r in rows}
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for name in kernels:
                for r in rows:
                    times.setdefault((name, r), []).append(
                        seconds(calls[name], inputs[r], args.repeats)
                    )
        for name in kernels:
            ms = [statistics.median(times[name, r]) * 1e3 for r in rows]
            bits = KERNELS[name][1]
            rate = args.copies * n * k * bits / 8 / (ms[0] / 1e3) / 1e9 if rows[0] == 1 else 0
            print(
                f"| {shape} | {name} | "
                + " | ".join(f"{t:.3f}" for t in ms)
                + f" | {rate:.1f} | "
                + " | ".join(f"{t / ms[0]:.2f}" for t in ms[1:])
                + " |"
            )


if __name__ == "__main__":
    main()
