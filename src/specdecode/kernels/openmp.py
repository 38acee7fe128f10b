"""The OpenMP runtime's thread pools, and why a decoding thread must not share the CPUs with one.

PyTorch's CPU operations and the kernels (`at::parallel_for`) run on OpenMP. GNU OpenMP (libgomp,
the runtime PyTorch's Linux wheels ship) keeps one pool of threads per thread that starts
parallel work, and its waiting threads spin before they sleep, so that the next parallel region
starts at once. But once there are more OpenMP threads than CPUs it spins 100 times instead of
300,000 (GOMP_SPINCOUNT in libgomp's manual): every region then waits for its threads to wake
from a futex. A server loads its models on the main thread (one pool) and decodes on its worker
thread (a second pool): on 2 cores that is 4 threads for 2 CPUs, and the worker decoded well
below the speed of the same code on the main thread (docs/results.md). `release_pool` hands the calling thread's pool back (OpenMP 5.0's
`omp_pause_resource_all`, a soft pause), so the decoding thread's pool is the only one left.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release the threads, keep the runtime usable


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime this process has loaded (found by path in /proc/self/maps: PyTorch
    loads it privately, so its symbols are not global), or None: another runtime, none, or no
    /proc (not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]
    except OSError:
        return None
    paths = {f[5].strip() for f in fields if len(f) == 6}  # address ... inode path
    for path in sorted(paths):
        if os.path.basename(path).startswith("libgomp") and os.path.exists(path):
            try:
                lib = ctypes.CDLL(path)  # the loaded library again: dlopen does not load twice
            except OSError:
                return None
            return lib if hasattr(lib, "omp_pause_resource_all") else None
    return None


def release_pool() -> bool:
    """Release the OpenMP threads the calling thread started (it gets a new pool should it run
    parallel work again). Call it on a thread that is done computing before another thread
    takes over (the server's main thread once its worker starts). True when a pool was
    released; False where the runtime is not libgomp, too old, or busy (inside a parallel
    region)."""
    import torch  # openmp.py needs no torch to import; here it loads the OpenMP runtime

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    lib = _libgomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(ctypes.c_int(OMP_PAUSE_SOFT)) == 0
