"""A 4-bit target's prefill on its tiles against its panels unpacked to bfloat16 on AMX tiles
(`linear_int4_prefill`, what `cpu_linear.prefill_linear` hands the lean forward past
VERIFY_TOKENS rows where it measured faster), side by side in one process.

    python lab/probes/int4_prefill_amx.py --model qwen2.5-coder-1.5b-instruct:int4 --tokens 200,512

First one linear's product (8 copies of the 1.5B target's up projection, random 4-bit weights)
at several row counts both ways, then the model's prefill of random prompts, rounds
alternating between `SPECDECODE_PREFILL_LINEARS=kernel` and `torch` (the AMX path): the best
of the rounds in ms and tokens/s, and whether the last position's argmax agrees.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from specdecode import load_model
from specdecode.kernels.build import extension
from specdecode.kernels.panels import PREFILL_ENV, best_ms
from specdecode.kernels.quantize import _Q4, int4_shift, quantize_linears
from specdecode.models.lean import target_cache


def linear_rates(rows: list[int]) -> None:
    n, k = 8960, 1536
    layers = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(8)]
    quantize_linears(torch.nn.Sequential(*layers), bits=4)
    ext = extension()
    calls = []
    for layer in layers:
        panels, codes, steps = (layer._buffers[name] for name in _Q4)
        calls.append((panels, codes, steps, int4_shift(codes.shape[1], steps.shape[1])))
    for m in rows:
        x = torch.randn(m, k).bfloat16()
        with torch.inference_mode():
            tile = best_ms(lambda x=x: [layer(x) for layer in layers])
            amx = best_ms(
                lambda x=x: [
                    ext.linear_int4_prefill(x, p, n, c, s, sh, None) for p, c, s, sh in calls
                ]
            )
        macs = m * n * k * len(layers)
        print(
            f"  {m:4d} rows: 4-bit tile {tile:7.1f} ms ({macs / tile / 1e6:5.0f} GMAC/s), "
            f"AMX bfloat16 {amx:7.1f} ms ({macs / amx / 1e6:5.0f} GMAC/s): {tile / amx:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct:int4")
    parser.add_argument("--tokens", default="200,512", help="prompt lengths")
    parser.add_argument("--rows", default="32,128,256,512", help="rows of the linear's product")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not extension().bf16_amx_supported():
        raise SystemExit("this CPU or OS has no AMX bfloat16 tiles")
    print("one linear (8 x [8960, 1536], 4-bit), best of 3:")
    linear_rates([int(r) for r in args.rows.split(",")])
    model = load_model(args.model, device="cpu").model
    for n in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(n))
        best: dict[str, float] = {}
        last: dict[str, int] = {}
        for _ in range(args.rounds):
            for mode in ("kernel", "torch"):
                os.environ[PREFILL_ENV] = mode
                cache = target_cache(model)
                start = time.perf_counter()
                logits = cache.forward(ids, last_only=True)
                seconds = time.perf_counter() - start
                best[mode] = min(best.get(mode, seconds), seconds)
                last[mode] = int(logits.argmax())
        tile, amx = best["kernel"], best["torch"]
        print(
            f"prefill of {n} tokens: 4-bit tile {tile * 1e3:.0f} ms ({n / tile:.0f} tok/s), "
            f"AMX bfloat16 {amx * 1e3:.0f} ms ({n / amx:.0f} tok/s): {tile / amx:.2f}x; "
            f"next token the same: {last['kernel'] == last['torch']}"
        )


if __name__ == "__main__":
    main()
