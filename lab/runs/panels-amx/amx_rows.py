"""One bfloat16 linear of the 1.5B target over M rows on the kernel's panels: AVX-512 BF16 dot
products against AMX tiles (`use_bf16_amx`), and PyTorch's own product on a row-major weight
(oneDNN); best of 10 each; then the rows of a 24-row call against one-row calls (bit for bit?).

    PYTHONPATH=src python lab/runs/panels-amx/amx_rows.py
"""

import time

import torch
import torch.nn.functional as F

from specdecode.kernels.build import extension, use_bf16_amx
from specdecode.kernels.panels import pack_panels


def best_ms(fn, n=10):
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main():
    ext = extension()
    if not use_bf16_amx(True):
        raise SystemExit("this CPU (or OS) has no AMX tiles")
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}")
    for n, k in ((8960, 1536), (1536, 8960)):
        weight = (torch.randn(n, k) * 0.02).bfloat16()
        panels = pack_panels(weight)
        print(f"\nlinear [{n}, {k}]\n")
        print("| rows | AVX-512 BF16 ms | AMX ms | PyTorch ms | AVX-512 / AMX |")
        print("|---:|---:|---:|---:|---:|")
        with torch.inference_mode():
            for m in (1, 2, 4, 8, 12, 16, 24, 32, 64, 128, 256, 512):
                x = torch.randn(m, k).bfloat16()
                use_bf16_amx(False)
                dot = best_ms(lambda x=x, p=panels, n=n: ext.linear_packed(x, p, n, None))
                use_bf16_amx(True)
                amx = best_ms(lambda x=x, p=panels, n=n: ext.linear_packed(x, p, n, None))
                ref = best_ms(lambda x=x, w=weight: F.linear(x, w))
                print(f"| {m} | {dot:.3f} | {amx:.3f} | {ref:.3f} | {dot / amx:.2f}x |", flush=True)
            x = torch.randn(24, k).bfloat16()
            together = ext.linear_packed(x, panels, n, None)
            alone = torch.cat([ext.linear_packed(x[i : i + 1], panels, n, None) for i in range(24)])
            use_bf16_amx(False)
            dot = ext.linear_packed(x, panels, n, None)
            use_bf16_amx(True)
        same = (together == dot).float().mean().item()
        print(f"\nAMX rows bit for bit one-row calls: {torch.equal(together, alone)}; "
              f"outputs equal to AVX-512 BF16's: {same:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
