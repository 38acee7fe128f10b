"""The bfloat16 1.5B target's prefill on the lean forward (a fresh `target_cache`), its
projections on the kernel's panels against PyTorch's product ($SPECDECODE_PREFILL_LINEARS =
kernel / torch), interleaved, in one process; then one verification of 12 rows after it (the
panels either way). Best of 3 per setting.

    SPECDECODE_BF16_AMX=0 PYTHONPATH=src python lab/runs/prefill-amx/prefill.py
"""

import os
import time

import torch

from specdecode import load_model
from specdecode.lean import target_cache


def main():
    model = load_model("qwen2.5-coder-1.5b-instruct").model
    ids = torch.randint(0, 150000, (512,), generator=torch.Generator().manual_seed(0))
    print("| prompt tokens | panels ms | PyTorch's product ms | ratio |")
    print("|---:|---:|---:|---:|")
    for n in (64, 129, 256, 512):
        best = {}
        for _ in range(3):
            for mode in ("kernel", "torch"):
                os.environ["SPECDECODE_PREFILL_LINEARS"] = mode
                with torch.inference_mode():
                    cache = target_cache(model)
                    start = time.perf_counter()
                    cache.forward(ids[:n], last_only=True)
                    ms = (time.perf_counter() - start) * 1e3
                best[mode] = min(best.get(mode, ms), ms)
        ratio = best["kernel"] / best["torch"]
        print(f"| {n} | {best['kernel']:.0f} | {best['torch']:.0f} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
