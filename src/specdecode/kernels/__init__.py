"""Compute kernels that make decoding on CPU memory-bound (see linear_avx2.cpp for why)."""

from specdecode.kernels.cpu_linear import (
    KERNEL_MODES,
    KernelUnavailable,
    apply_kernel,
    int4_weights,
    int8_weights,
    pack_int4_panels,
    pack_int8_panels,
    pack_panels,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    restore_linears,
    row_major,
    swap_linears,
    unavailable_reason,
    unpack_panels,
)

__all__ = [
    "KERNEL_MODES",
    "KernelUnavailable",
    "apply_kernel",
    "int4_weights",
    "int8_weights",
    "pack_int4_panels",
    "pack_int8_panels",
    "pack_panels",
    "quantize_int4",
    "quantize_int8",
    "quantize_linears",
    "restore_linears",
    "row_major",
    "swap_linears",
    "unavailable_reason",
    "unpack_panels",
]
