"""The int4 tile on AMX int8 tiles against the AVX-512 VNNI tile, by the number of tokens, in one
process (the two give the same bits, so one switch, `use_int4_amx`, picks per call): two 4-bit
linears of the 1.5B target's shapes (random weights, best of 20 calls), then the whole `:int4`
target on the lean forward (one forward of n new tokens after a 128-token prompt, best of 5,
the two paths interleaved) and the prompt's prefill.

    PYTHONPATH=src python lab/runs/int4-amx/rows.py
"""

import time

import torch

from specdecode import load_model
from specdecode.kernels.build import extension, use_int4_amx
from specdecode.kernels.quantize import int4_shift, pack_int4_panels, quantize_int4
from specdecode.lean import target_cache

LINEAR_ROWS = (1, 2, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128)
TARGET_NEW = (1, 4, 5, 6, 8, 12, 16, 24, 32, 64)
PATHS = (("VNNI", 0), ("AMX", 1))  # use_int4_amx(rows): 0 never, 1 every call


def best_ms(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    if use_int4_amx(1) == 0:
        raise SystemExit("this CPU (or OS) has no AMX int8 tiles")
    ext = extension()
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}")
    with torch.inference_mode():
        for n, k in ((8960, 1536), (1536, 8960)):
            codes = quantize_int4((torch.randn(n, k) * 0.02).bfloat16())
            panels, packed, steps = pack_int4_panels(*codes)
            shift = int4_shift(packed.shape[1], steps.shape[1])
            print(f"\n4-bit linear [{n}, {k}]\n")
            print("| tokens | VNNI ms | AMX ms | VNNI / AMX |")
            print("|---:|---:|---:|---:|")
            weights = (panels, n, packed, steps, shift)
            for m in LINEAR_ROWS:
                x = torch.randn(m, k).bfloat16()
                ms = {}
                for name, rows in PATHS:
                    use_int4_amx(rows)
                    ms[name] = best_ms(
                        lambda x=x, w=weights: ext.linear_int4_packed(x, *w, None), 20
                    )
                print(f"| {m} | {ms['VNNI']:.3f} | {ms['AMX']:.3f} | {ms['VNNI'] / ms['AMX']:.2f}x |",
                      flush=True)  # fmt: skip
        model = load_model("qwen2.5-coder-1.5b-instruct:int4").model
        ids = torch.randint(0, 150000, (200,), generator=torch.Generator().manual_seed(0))
        best: dict = {}
        for _ in range(5):
            for name, rows in PATHS:
                use_int4_amx(rows)
                prompt = target_cache(model)
                start = time.perf_counter()
                prompt.forward(ids[:128], last_only=True)
                key = (name, "prefill of 128")
                best[key] = min(best.get(key, 1e9), time.perf_counter() - start)
                for n in TARGET_NEW:
                    cache = prompt.copy()
                    start = time.perf_counter()
                    cache.forward(ids[128 : 128 + n])
                    best[(name, n)] = min(best.get((name, n), 1e9), time.perf_counter() - start)
    print("\nthe :int4 target, one forward after a 128-token prompt\n")
    print("| new tokens | VNNI ms | v(n) | AMX ms | v(n) | VNNI / AMX |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in (*TARGET_NEW, "prefill of 128"):
        a, b = best[("VNNI", n)] * 1e3, best[("AMX", n)] * 1e3
        a1, b1 = best[("VNNI", 1)] * 1e3, best[("AMX", 1)] * 1e3
        va, vb = ("", "") if isinstance(n, str) else (f"{a / a1:.2f}", f"{b / b1:.2f}")
        print(f"| {n} | {a:.1f} | {va} | {b:.1f} | {vb} | {a / b:.2f}x |")
    use_int4_amx(8)


if __name__ == "__main__":
    main()
