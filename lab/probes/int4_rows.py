"""The 4-bit target over many rows: the tile's rate per row count, v(n) up to 64, and a prefill.

    python lab/probes/int4_rows.py --model qwen2.5-coder-1.5b-instruct:int4

Three measurements in one process (issue 58's "v(32) <= 2.0, v(64) <= 3.0" and "prefill of 512
tokens"): (1) one linear's product (8 copies of the 1.5B target's up projection, random 4-bit
weights, so 110 MB from memory) at several row counts, in ms and multiply-adds per second: where
the rate stops growing with rows the tile is bound by arithmetic; (2) the target's forward over n
new tokens after a 128-token prefix, on the forward it decodes with (`target_cache`), as v(n) =
ms(n) / ms(1), medians of `--repeats`; (3) the prefill of a random prompt of `--prompt` tokens,
best of `--rounds`, in tokens/s.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from specdecode import load_model
from specdecode.auto.costs import forward_seconds
from specdecode.kernels.panels import best_ms
from specdecode.kernels.quantize import quantize_linears
from specdecode.models.lean import target_cache


def linear_rates(rows: list[int]) -> None:
    n, k = 8960, 1536
    layers = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(8)]
    quantize_linears(torch.nn.Sequential(*layers), bits=4)
    one = None
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        with torch.inference_mode():
            ms = best_ms(lambda x=x: [layer(x) for layer in layers])
        one = one or ms
        macs = m * n * k * len(layers)
        print(
            f"  {m:4d} rows: {ms:8.1f} ms, {ms / one:6.2f} x one row, {macs / ms / 1e6:5.0f} GMAC/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--rows", default="1,4,8,12,16,24,32,48,64,128,512")
    parser.add_argument("--tokens", default="1,2,4,8,12,16,24,32,48,64")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma list of linear,v,prefill to skip")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}"
    )
    if "linear" not in skip:
        print("one linear (8 x [8960, 1536], 4-bit tiles):")
        linear_rates([int(m) for m in args.rows.split(",")])
    if {"v", "prefill"} <= skip:
        return
    model = load_model(args.model).model
    if "v" not in skip:
        sizes = [int(n) for n in args.tokens.split(",")]
        seconds = forward_seconds(model, sizes, 128, args.repeats, cache_type=target_cache)
        print(f"{args.model}: forward over n new tokens after 128")
        print("| n | ms | v(n) |")
        print("|---:|---:|---:|")
        for n in sizes:
            print(f"| {n} | {seconds[n] * 1000:.1f} | {seconds[n] / seconds[1]:.2f} |")
    if "prefill" not in skip:
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(1))
        best = float("inf")
        with torch.inference_mode():
            for _ in range(args.rounds):
                cache = target_cache(model)
                start = time.perf_counter()
                logits = cache.forward(ids, last_only=True)
                best = min(best, time.perf_counter() - start)
        print(
            f"prefill of {args.prompt} tokens: best {best * 1000:.0f} ms, "
            f"{args.prompt / best:.1f} tok/s, next token {int(logits[-1].argmax())}"
        )


if __name__ == "__main__":
    main()
