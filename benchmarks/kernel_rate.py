"""The bfloat16 panel kernel's arithmetic rate: one linear layer over 1-12 tokens, weights in cache.

    python benchmarks/kernel_rate.py --n 8960 --k 1536

Verifying more tokens costs more once the kernel is bound by arithmetic, not by reading the
weights. This times one linear layer small enough to stay in the last-level cache (27.5 MB by
default, within the 32 MB L3 of the machine in docs/benchmarks.md; so memory is out of the
picture) and prints multiply-adds per second: where it stops growing with the number of tokens,
the kernel is bound by arithmetic (the peak: cores x 2 FMA units x 8 float32 lanes per cycle on
AVX2) and little but fewer multiply-adds would make verification cheaper.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.kernels.cpu_linear import swap_linears


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8960, help="output features")
    parser.add_argument("--k", type=int, default=1536, help="input features")
    parser.add_argument("--tokens", default="1,2,3,4,5,6,7,8,12")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = torch.nn.Linear(args.k, args.n, bias=False).to(torch.bfloat16)
    swap_linears(layer)
    print(f"linear {args.n} x {args.k}, bfloat16 panels, {torch.get_num_threads()} threads")
    print("| tokens | ms | GFMA/s |\n|---|---|---|")
    with torch.inference_mode():
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, args.k).to(torch.bfloat16)
            for _ in range(5):
                layer(x)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                layer(x)
                times.append(time.perf_counter() - start)
            median = sorted(times)[len(times) // 2]
            print(f"| {m} | {1e3 * median:.2f} | {m * args.n * args.k / median / 1e9:.1f} |")


if __name__ == "__main__":
    main()
