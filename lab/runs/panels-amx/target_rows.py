"""The bfloat16 1.5B target on the lean forward: one forward of n new tokens after a 128-token
prompt (a decoding step at n = 1, a verification above), its panels on AVX-512 BF16 against AMX
tiles (`use_bf16_amx`), interleaved in one process, best of 5; and the prompt's prefill.

    PYTHONPATH=src python lab/runs/panels-amx/target_rows.py
"""

import time

import torch

from specdecode import load_model
from specdecode.kernels.build import use_bf16_amx
from specdecode.lean import target_cache


def main():
    model = load_model("qwen2.5-coder-1.5b-instruct").model
    ids = torch.randint(0, 150000, (160,), generator=torch.Generator().manual_seed(0))
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(5):
            for name, amx in (("AVX-512 BF16", False), ("AMX", True)):
                use_bf16_amx(amx)
                prompt = target_cache(model)
                start = time.perf_counter()
                prompt.forward(ids[:128], last_only=True)
                key = (name, 0)
                best[key] = min(best.get(key, 1e9), time.perf_counter() - start)
                for n in (1, 2, 4, 8, 12, 16, 24, 32):
                    cache = prompt.copy()
                    start = time.perf_counter()
                    cache.forward(ids[128 : 128 + n])
                    best[(name, n)] = min(best.get((name, n), 1e9), time.perf_counter() - start)
    use_bf16_amx(True)
    print("| new tokens | AVX-512 BF16 ms | v(n) | AMX ms | v(n) | AVX-512 / AMX |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (1, 2, 4, 8, 12, 16, 24, 32):
        a, b = best[("AVX-512 BF16", n)] * 1e3, best[("AMX", n)] * 1e3
        a1, b1 = best[("AVX-512 BF16", 1)] * 1e3, best[("AMX", 1)] * 1e3
        print(f"| {n} | {a:.1f} | {a / a1:.2f} | {b:.1f} | {b / b1:.2f} | {a / b:.2f}x |")
    a, b = best[("AVX-512 BF16", 0)] * 1e3, best[("AMX", 0)] * 1e3
    print(f"| prefill of 128 | {a:.0f} | | {b:.0f} | | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
