"""One bfloat16 linear [8960, 1536] (the 1.5B target's MLP up projection) over M rows: the
kernel's panels, PyTorch's product on a row-major weight, and PyTorch's product on the weight
unpacked from its panels for the call (what a prefill on PyTorch's product runs). Best of 5.

    SPECDECODE_BF16_AMX=0 PYTHONPATH=src python lab/runs/prefill-amx/linear_rows.py
"""

import time

import torch
import torch.nn.functional as F

from specdecode.kernels.build import extension
from specdecode.kernels.panels import pack_panels, unpack_panels


def best_ms(fn, n=5):
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main():
    ext = extension()
    torch.manual_seed(0)
    n, k = 8960, 1536
    weight = (torch.randn(n, k) * 0.02).bfloat16()
    panels = pack_panels(weight)
    print(
        f"threads {torch.get_num_threads()}; unpack alone {best_ms(lambda: unpack_panels(panels, n, k)):.2f} ms"
    )
    print("| rows | panels ms | PyTorch ms | PyTorch + unpack ms |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for m in (1, 8, 16, 32, 64, 128, 129, 256, 512):
            x = torch.randn(m, k).bfloat16()
            a = best_ms(lambda x=x: ext.linear_packed(x, panels, n, None))
            b = best_ms(lambda x=x: F.linear(x, weight))
            c = best_ms(lambda x=x: F.linear(x, unpack_panels(panels, n, k)))
            print(f"| {m} | {a:.2f} | {b:.2f} | {c:.2f} |", flush=True)


if __name__ == "__main__":
    main()
