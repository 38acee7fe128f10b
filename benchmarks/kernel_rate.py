"""The bfloat16 panel kernel's rate on one linear layer shape over 1-12 tokens.

    python -m benchmarks.kernel_rate --n 8960 --k 1536
    python -m benchmarks.kernel_rate --copies 24 --tokens 1,6,12 --prefetch 2048,8192

Verifying more tokens costs more once the kernel is bound by arithmetic, not by reading the
weights. By default this times one linear layer small enough to stay in the last-level cache
(27.5 MB, within the 32 MB L3 of the machines in lab/benchmarks.md; so memory is out of the
picture) and prints multiply-adds per second: where it stops growing with the number of tokens,
the kernel is bound by arithmetic (the peak: cores x FMA units x lanes per cycle) and little but
fewer multiply-adds would make verification cheaper.

`--copies C` runs C copies of the layer one after another, so that the weights come from memory
as in a model's forward (24 copies of the default shape: 660 MB), and prints v(n), the time over
n tokens / over one. `--prefetch D1,D2,...` (AVX-512 BF16 panels only) alternates software
prefetch distances in elements, a round each, in one process: speed only, the results are the
same at any distance.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specdecode.kernels.build import bf16_dot_prefetch, panels_isa
from specdecode.kernels.cpu_linear import swap_linears


def seconds(
    layers: Sequence[Callable[[torch.Tensor], Any]], x: torch.Tensor, repeats: int
) -> float:
    """Median seconds of one pass of x through every layer (any callable; after one untimed
    pass)."""
    for layer in layers:
        layer(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            layer(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8960, help="output features")
    parser.add_argument("--k", type=int, default=1536, help="input features")
    parser.add_argument("--tokens", default="1,2,3,4,5,6,7,8,12")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--copies", type=int, default=1, help="layers in a row (out of cache)")
    parser.add_argument("--prefetch", default=None, help="AVX-512 BF16 prefetch distances")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (--prefetch)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    layers = []
    for _ in range(args.copies):
        layer = torch.nn.Linear(args.k, args.n, bias=False).to(torch.bfloat16)
        swap_linears(layer)
        layers.append(layer)
    sizes = [int(t) for t in args.tokens.split(",")]
    inputs = {m: torch.randn(m, args.k).to(torch.bfloat16) for m in sizes}
    distances = [int(d) for d in args.prefetch.split(",")] if args.prefetch else []
    if distances and panels_isa() != "avx512-bf16":
        raise SystemExit("--prefetch: the panels run on AVX2 here (no AVX-512 BF16)")
    mb = args.copies * args.n * args.k * 2 / 1e6
    print(
        f"{args.copies} x linear {args.n} x {args.k} ({mb:.0f} MB), bfloat16 panels on "
        f"{panels_isa()}, {torch.get_num_threads()} threads"
    )
    runs: dict[int, dict[int, list[float]]] = {}
    for _ in range(args.rounds if distances else 1):
        for distance in distances or [0]:
            if distance:
                bf16_dot_prefetch(distance)
            for m in sizes:
                runs.setdefault(distance, {}).setdefault(m, []).append(
                    seconds(layers, inputs[m], args.repeats)
                )
    head = "| prefetch " if distances else ""
    print(f"{head}| tokens | ms | v(n) | GFMA/s |\n{'|---' * (4 + bool(distances))}|")
    for distance, by_size in runs.items():
        one = statistics.median(by_size[sizes[0]]) if sizes[0] == 1 else None
        for m, values in by_size.items():
            t = statistics.median(values)
            v = f"{t / one:.2f}" if one else "-"
            rate = m * args.n * args.k * args.copies / t / 1e9
            cell = f"| {distance} " if distances else ""
            print(f"{cell}| {m} | {1e3 * t:.2f} | {v} | {rate:.1f} |")


if __name__ == "__main__":
    main()
