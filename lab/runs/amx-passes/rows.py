"""The bfloat16 panels on AMX tiles by the number of rows, for the code on PYTHONPATH: two
linears of the 1.5B target (best of 20 calls) and the whole target on the lean forward (one
forward of n new tokens after a 128-token prompt, best of 5; and the prompt's prefill). Prints
one JSON object; run it once per code version, alternating, and compare with `table.py`.

    git archive 890d546 src | tar -x -C /tmp/old     # the code before one pass per 32 rows
    PYTHONPATH=/tmp/old/src python lab/runs/amx-passes/rows.py before > before-1.json
    PYTHONPATH=src python lab/runs/amx-passes/rows.py after > after-1.json   # and -2 each; README.md
"""

import json
import sys
import time

import torch

from specdecode import load_model
from specdecode.kernels.build import extension, use_bf16_amx
from specdecode.kernels.panels import pack_panels
from specdecode.lean import target_cache

LINEAR_ROWS = (1, 8, 16, 17, 20, 24, 28, 32, 33, 40, 48, 64, 96, 128)
TARGET_NEW = (1, 8, 16, 20, 24, 28, 32, 40, 48, 64)


def best_ms(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    if not use_bf16_amx(True):
        raise SystemExit("this CPU (or OS) has no AMX tiles")
    ext = extension()
    torch.manual_seed(0)
    out: dict = {"label": sys.argv[1] if len(sys.argv) > 1 else "", "linear": {}, "target": {}}
    with torch.inference_mode():
        for n, k in ((8960, 1536), (1536, 8960)):
            panels = pack_panels((torch.randn(n, k) * 0.02).bfloat16())
            row = {}
            for m in LINEAR_ROWS:
                x = torch.randn(m, k).bfloat16()
                row[m] = best_ms(lambda x=x, p=panels, n=n: ext.linear_packed(x, p, n, None), 20)
            out["linear"][f"{n}x{k}"] = row
        model = load_model("qwen2.5-coder-1.5b-instruct").model
        ids = torch.randint(0, 150000, (200,), generator=torch.Generator().manual_seed(0))
        best: dict = {}
        for _ in range(5):
            prompt = target_cache(model)
            start = time.perf_counter()
            prompt.forward(ids[:128], last_only=True)
            best["prefill 128"] = min(best.get("prefill 128", 1e9), time.perf_counter() - start)
            for n in TARGET_NEW:
                cache = prompt.copy()
                start = time.perf_counter()
                cache.forward(ids[128 : 128 + n])
                best[n] = min(best.get(n, 1e9), time.perf_counter() - start)
        out["target"] = {str(key): value * 1e3 for key, value in best.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
