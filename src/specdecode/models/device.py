"""Where and in what precision a model runs: `--dtype` and `--device` values resolved to torch's."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}: choose one of {', '.join(sorted(set(DTYPES)))}"
        ) from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None`/"auto" means CUDA when present, else CPU; an explicit CUDA request without CUDA fails."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available here")
    return dev
