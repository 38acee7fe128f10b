"""Why a training step was slow here: elementwise work on a [90, 151936] float32 tensor (one
answer's positions over the vocabulary), timed with glibc's default malloc and with
MALLOC_MMAP_MAX_=0 (no fresh mmap per large tensor, the memory reused):

    python lab/runs/distill-amx/probes/fresh_pages.py
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=4294967295 python lab/runs/distill-amx/probes/fresh_pages.py
"""

import time

import torch

x = torch.randn(90, 151936)
m = x.amax(-1, keepdim=True)
xb = x.bfloat16()


def ms(f, n=10):
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1000


sub, exp, up, lse = ms(lambda: x - m), ms(x.exp), ms(xb.float), ms(lambda: x.logsumexp(-1))
print(f"ms: x - max {sub:.1f}, exp {exp:.1f}, bfloat16 -> float32 {up:.1f}, logsumexp {lse:.1f}")
