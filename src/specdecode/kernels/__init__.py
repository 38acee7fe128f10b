"""Compute kernels that make decoding on CPU memory-bound (see linear_avx2.cpp for why)."""

from specdecode.kernels.cpu_linear import (
    KERNEL_MODES,
    KernelUnavailable,
    apply_kernel,
    quantize_int8,
    quantize_linears,
    restore_linears,
    swap_linears,
    unavailable_reason,
)

__all__ = [
    "KERNEL_MODES",
    "KernelUnavailable",
    "apply_kernel",
    "quantize_int8",
    "quantize_linears",
    "restore_linears",
    "swap_linears",
    "unavailable_reason",
]
