"""The lean forward's fused attention (`rope_attention`, kernels/draft_ops.cpp) per call.

    python lab/probes/attention_rate.py
    python lab/probes/attention_rate.py --shapes 12x2x128 --keys 150,600,1500 --tokens 1,3,12

One layer's rotary embedding, cache write and attention for `tokens` new query rows over
`keys` cached positions (causal), at a model's head shapes HEADSxKV_HEADSxHEAD_DIM (defaults:
the 0.5B draft's 14x2x64 and the 1.5B target's 12x2x128), on random float32 caches: median
microseconds per call over `--repeats` calls, after 30 of warm-up, on all threads. Times
depend on nothing but the shapes, so two checkouts compare by running this script on each
(`PYTHONPATH=<checkout>/src`, and `TORCH_EXTENSIONS_DIR` per checkout, or each run rebuilds
the kernels); as everywhere on a shared VM, alternate them and repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.kernels.build import extension


def seconds_per_call(call, repeats: int) -> float:
    """Median seconds of `repeats` calls, after 30 untimed ones."""
    for _ in range(30):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="14x2x64,12x2x128", help="HEADSxKV_HEADSxHEAD_DIM")
    parser.add_argument("--keys", default="150,600,1500", help="cached positions before the call")
    parser.add_argument("--tokens", default="1,3,12", help="new query rows per call")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    ext = extension()
    gen = torch.Generator().manual_seed(0)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"rope_attention, median us per call, {torch.get_num_threads()} threads\n")
    print(
        "| heads x kv heads x head dim | cached keys | "
        + " | ".join(f"{n} rows" for n in tokens)
        + " |"
    )
    print("|---|---:|" + "---:|" * len(tokens))
    for shape in args.shapes.split(","):
        heads, kv_heads, d = (int(v) for v in shape.split("x"))
        for past in (int(k) for k in args.keys.split(",")):
            capacity = past + max(tokens)
            keys = torch.randn(kv_heads, capacity, d, generator=gen)
            values = torch.randn(kv_heads, capacity, d, generator=gen)
            row = []
            for n in tokens:
                q = torch.randn(n, heads * d, generator=gen).bfloat16()
                k = torch.randn(n, kv_heads * d, generator=gen).bfloat16()
                v = torch.randn(n, kv_heads * d, generator=gen).bfloat16()
                angles = torch.rand(n, d // 2, generator=gen)
                cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)

                args = (q, k, v, cos, sin, keys, values, past, None, d**-0.5)

                def call(args=args) -> None:
                    ext.rope_attention(*args)

                row.append(seconds_per_call(call, args.repeats) * 1e6)
            print(f"| {shape} | {past} | " + " | ".join(f"{us:.1f}" for us in row) + " |")


if __name__ == "__main__":
    main()
