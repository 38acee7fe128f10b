"""How the runtime and the apps read time and memory on any device: a clock that covers the
device's work, and this process's peak memory."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch


def clock_for(device: torch.device) -> Callable[[], float]:
    """time.perf_counter, synchronising the device first on CUDA so times cover the work."""
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


def peak_memory(device: torch.device) -> dict[str, Any]:
    """This process's high-water mark of resident memory so far (and the GPU's allocations)."""
    peak = {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peak["cuda_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return peak
