"""Compute kernels that make decoding on CPU memory-bound (see linear_avx2.cpp for why).

cpu.py: what this CPU runs them on; build.py: the extension and its switches; panels.py:
bfloat16 weights in the kernel's panels; quantize.py: int8 / 4-bit weights (drafts and targets); cpu_linear.py: a
model's linears onto the kernels, by mode; attention.py: attention for few query tokens.
"""

from specdecode.kernels.build import KernelUnavailable, unavailable_reason
from specdecode.kernels.cpu_linear import (
    KERNEL_MODES,
    apply_kernel,
    restore_linears,
    swap_linears,
)
from specdecode.kernels.panels import pack_panels, row_major, unpack_panels
from specdecode.kernels.quantize import (
    int4_weights,
    int8_weights,
    pack_int4_panels,
    pack_int8_panels,
    quantize_int4,
    quantize_int8,
    quantize_linears,
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
