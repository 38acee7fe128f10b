"""A model spec's `:int8` / `:int4` suffix applied, for a target and a draft alike.

`check_quantizable` says, before anything is loaded, why a quantized model cannot run here;
`quantize_loaded` puts a loaded model's linears on int8 or 4-bit weights
(`kernels.quantize.quantize_linears`). Both raise ValueError naming the alternatives: a quantized
model never falls back to its bfloat16 weights in silence.

A quantized target is the model speculation reproduces (lossless to it, not to its bfloat16
original): its name carries the suffix (`LoadedModel.name`, the bench's records), and its bfloat16
weights are freed (`keep_weights=False`) but for an output layer tied to the embedding; a
draft's too, as nothing in decoding reads them.

`:int4` of a GGUF-made model (a preset, a `.gguf` path) takes the file's own 4-bit codes where it
has them (models/gguf_int4.py), its Q6_K grid for Q6_K linears and int8 for its linears of other
types; a stderr line says so,
and `LoadedModel.extra["int4_weights"]` ("gguf" or "requantized"). Other models are re-quantized.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from specdecode.core.draft_spec import ModelSpec
from specdecode.kernels import build as kernel_build
from specdecode.kernels.build import KernelUnavailable
from specdecode.kernels.panels import eligible
from specdecode.kernels.quantize import is_quantized, quant_name, quantize_linears
from specdecode.models.device import resolve_device, resolve_dtype
from specdecode.models.gguf_int4 import gguf_codes, preset_gguf

# below this share of a model's multiplied weights in quantizable nn.Linear layers, `:int4` would
# leave it mostly in bfloat16 (GPT-2's transformers Conv1D layers are not nn.Linear)
MIN_QUANTIZED_SHARE = 0.5


def quantization_problem(
    dtype: torch.dtype, device: torch.device, kernel_mode: str | None = None
) -> tuple[str, str] | None:
    """(what stops int8 / 4-bit weights from running, what to do instead), or None when they can:
    they run on specdecode's CPU kernels only, on bfloat16 activations."""
    if dtype != torch.bfloat16:
        return f"the dtype is {_dtype_name(dtype)}", "use --dtype bfloat16"
    if device.type != "cpu":
        return f"the device is {device}", "use --device cpu"
    if kernel_mode == "off":
        return "the kernel is off (--kernel off or $SPECDECODE_KERNEL=off)", "use --kernel auto"
    reason = kernel_build.unavailable_reason()
    if reason is not None:
        return (
            f"the kernel cannot run here: {reason}",
            "the CPU kernels need a CPU with AVX2 and FMA, a C++ compiler and ninja",
        )
    return None


def check_quantizable(
    spec: ModelSpec,
    dtype: str | torch.dtype,
    device: str | torch.device | None,
    kernel_mode: str | None,
    role: str = "model",
) -> None:
    """ValueError, before loading, where `spec`'s quantization cannot run with these settings
    (`kernel_mode` as cpu_linear.resolve_mode gives it); nothing for an unquantized spec."""
    if spec.quantization is None:
        return
    problem = quantization_problem(resolve_dtype(dtype), resolve_device(device), kernel_mode)
    if problem is not None:
        raise _cannot_run(spec, role, *problem)


def reads_file_codes(spec: ModelSpec, role: str) -> bool:
    """Whether `spec` in `role` runs on a GGUF-made model's own codes (a target's `:int4`, so
    that a preset's fetch keeps its GGUF). A draft's `:int4` is verified token by token: it
    takes 4 bits everywhere (fewer bytes per draft forward), its output layer too where it is
    tied to the embedding (a target's keeps int8), and reads no file."""
    return spec.bits == 4 and role != "draft"


def quantize_loaded(
    loaded: Any,
    spec: ModelSpec,
    *,
    keep_weights: bool,
    role: str = "model",
    release_pages: bool = False,
):
    """`loaded` (a LoadedModel) with its linears on the weights `spec.quantization` asks for
    (int8 or int4), its kernel and name saying so (`name:int4`); the same LoadedModel.

    `keep_weights=False` frees the bfloat16 weights of the quantized layers (nothing in decoding
    reads them; a distillation keeps its draft's). ValueError where that cannot run, or where
    too little of the model is in nn.Linear layers for the suffix to mean anything.
    `release_pages` (`kernels.quantize.free_weight`): for a model nothing outside shares."""
    if spec.quantization is None:
        return loaded
    problem = quantization_problem(loaded.dtype, loaded.device)
    if problem is not None:
        raise _cannot_run(spec, role, *problem)
    share = _linear_share(loaded.model)
    if share < MIN_QUANTIZED_SHARE:
        raise ValueError(
            f"{spec}: only {share:.0%} of the {role}'s weights are in nn.Linear layers that "
            f"int8 / 4-bit weights replace (transformers' Conv1D, e.g. GPT-2's, is not one): "
            f"drop the :{spec.quantization} suffix"
        )
    file_grid = reads_file_codes(spec, role)
    tied_bits = 4 if role == "draft" else 8
    codes = _file_codes(loaded, spec) if file_grid else None
    if spec.bits == 4 and not file_grid:
        loaded.extra["int4_weights"] = "requantized"
    try:
        quantize_linears(
            loaded.model,
            bits=spec.bits,
            keep_weights=keep_weights,
            int4_codes=codes,
            tied_bits=tied_bits,
            q6_codes=codes.q6 if codes is not None else None,
            release_pages=release_pages,
        )
    except KernelUnavailable as err:
        raise _cannot_run(
            spec, role, f"the kernel cannot be used: {err}", "the CPU kernels need AVX2 and FMA"
        ) from err
    loaded.kernel = quant_name(spec.bits)  # type: ignore[arg-type]
    loaded.name = f"{loaded.name}:{spec.quantization}"
    return loaded


def _file_codes(loaded: Any, spec: ModelSpec) -> Any:
    """The GGUF codes (gguf_int4.GgufCodes) of a model loaded from a GGUF file (`extra["gguf"]`,
    or a preset's, `extra["preset"]`), or None (re-quantize), with a stderr line either way
    for a GGUF-made model."""
    path, preset = loaded.extra.get("gguf"), loaded.extra.get("preset")
    codes, what = None, ""
    loaded.extra["int4_weights"] = "requantized"
    if path is None and preset is not None:
        path, what = preset_gguf(preset)
    if path is not None:
        codes, what = gguf_codes(loaded.model, path)
    if codes is not None:
        loaded.extra["int4_weights"] = "gguf"
        print(f"{spec}: {what}", file=sys.stderr, flush=True)
    elif what:
        print(
            f"{spec}: not the GGUF's own codes: {what}; re-quantizing the loaded weights",
            file=sys.stderr,
            flush=True,
        )
    return codes


def _cannot_run(spec: ModelSpec, role: str, problem: str, instead: str) -> ValueError:
    # "int4 drafts run on the CPU kernel": the words tests and users have matched since drafts
    return ValueError(
        f"{spec}: {spec.quantization} {role}s run on the CPU kernel with bfloat16 activations, "
        f"and {problem}: {instead}, or drop the :{spec.quantization} suffix to run {spec.name} "
        "on its own weights"
    )


def _linear_share(model: torch.nn.Module) -> float:
    """The share of `model`'s multiplied weights (all parameters but an untied input embedding,
    a lookup) that sit in bfloat16 nn.Linear layers on the CPU (quantize_linears' layers)."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embed is not None and getattr(head, "weight", None) is not embed.weight:
        total -= embed.weight.numel()
    linear = sum(
        module.weight.numel()
        for module in model.modules()
        if eligible(module) or is_quantized(module)
    )
    return linear / total if total else 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
