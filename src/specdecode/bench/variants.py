"""The target's variants `specdecode compare` measures: quantized (int8, int4) and pruned
(drop-layers=N, prune-mlp=F), each made from the loaded reference target.

`Variant.parse` reads one variant's text; `check_variants` refuses, before any model is loaded,
what cannot run (a quantized variant needs bfloat16 on the CPU kernels); `check_fits` refuses
what the loaded model cannot take (too many layers dropped, a non-Llama MLP). A pruned variant
chooses what to remove from calibration text (`calibration_sequences`): the bench suite's
prompts that the quality measurement leaves out and the target's own greedy answers to them,
cached as token ids in the cache folder (`models.fetch.cache_dir`), keyed by the model and the
settings.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdecode.core.draft_spec import ModelSpec
from specdecode.data.suites import BenchPrompt
from specdecode.kernels import build as kernel_build
from specdecode.models import prune
from specdecode.models.fetch import cache_dir
from specdecode.models.loading import LoadedModel
from specdecode.models.prune import shared_copy
from specdecode.models.quantized import quantize_loaded
from specdecode.runtime.engine import SpeculativeDecoder

VARIANT_FORMS = (
    "int8, int4 (the target's linears on int8 / 4-bit weights), drop-layers=N (drop the N least "
    "influential decoder layers, N >= 1), prune-mlp=F (remove the fraction F in (0, 1) of every "
    "MLP's channels)"
)
_QUANTIZED = {"int8": 8, "int4": 4}
CALIBRATION_VERSION = 1  # bump when what is cached changes meaning


@dataclass(frozen=True)
class Variant:
    """One variant of the target: `kind` int8 / int4 / drop-layers / prune-mlp, `value` the
    layer count or the fraction (None for the quantized ones). `str()` is its canonical text."""

    kind: str
    value: int | float | None = None

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}={self.value:g}"

    @property
    def bits(self) -> int | None:
        return _QUANTIZED.get(self.kind)

    @property
    def pruned(self) -> bool:
        return self.kind in ("drop-layers", "prune-mlp")

    @classmethod
    def parse(cls, text: str) -> Variant:
        """A variant's text -> Variant; ValueError naming the allowed forms if it is not one."""
        name, sep, value = text.strip().partition("=")
        name, value = name.strip(), value.strip()
        if name in _QUANTIZED and not sep:
            return cls(name)
        if name == "drop-layers" and sep:
            if not re.fullmatch(r"\d+", value) or int(value) < 1:
                raise ValueError(f"variant {text!r}: drop-layers takes a whole number N >= 1")
            return cls(name, int(value))
        if name == "prune-mlp" and sep:
            try:
                fraction = float(value)
            except ValueError:
                fraction = float("nan")
            if not 0.0 < fraction < 1.0:  # a NaN fails too
                raise ValueError(f"variant {text!r}: prune-mlp takes a fraction in (0, 1)")
            return cls(name, fraction)
        raise ValueError(f"unknown variant {text!r}: choose from {VARIANT_FORMS}")


def parse_variants(items: list[str]) -> list[Variant]:
    """Variant texts -> Variants, each once, in order (ValueError for a bad or repeated one)."""
    variants = [Variant.parse(item) for item in items if item.strip()]
    repeated = [str(v) for i, v in enumerate(variants) if v in variants[:i]]
    if repeated:
        raise ValueError(f"variant {repeated[0]} is given twice")
    return variants


def check_variants(variants: list[Variant], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before anything is loaded, quantized variants where the kernels cannot run them:
    they need a bfloat16 target on the CPU and the kernels' build (never a silent fall-back)."""
    quantized = [str(v) for v in variants if v.bits]
    if not quantized:
        return
    if dtype != torch.bfloat16 or device.type != "cpu":
        raise ValueError(
            f"variants {', '.join(quantized)} run the target on the CPU kernels with bfloat16: "
            f"use --dtype bfloat16 on the CPU (asked for {str(dtype).removeprefix('torch.')} on "
            f"{device}), or leave the quantized variants out"
        )

    reason = kernel_build.unavailable_reason()
    if reason is not None:
        raise ValueError(
            f"variants {', '.join(quantized)} need specdecode's CPU kernels, which cannot be "
            f"built here: {reason}"
        )


def check_fits(variant: Variant, target: LoadedModel) -> None:
    """Refuse a variant the loaded target cannot take, before any calibration runs."""
    if variant.kind == "drop-layers":
        prune.check_drop_count(target.model, int(variant.value))  # type: ignore[arg-type]
    elif variant.kind == "prune-mlp":
        prune.gated_mlps(target.model)
        width = target.model.config.intermediate_size
        prune.kept_channels(width, float(variant.value))  # type: ignore[arg-type]
    elif variant.bits and (target.dtype != torch.bfloat16 or target.device.type != "cpu"):
        check_variants([variant], target.dtype, target.device)


def quantized_target(target: LoadedModel, bits: int) -> LoadedModel:
    """The target with its linears on int8 or 4-bit weights exactly as a `MODEL:int8` /
    `MODEL:int4` target gets them (models/quantized.py: a GGUF-made model's own 4-bit codes, its
    bfloat16 linear weights dropped), on a copy that shares the reference's other tensors (the
    reference keeps its own); ValueError where the kernels cannot run it.

    Speculation over it is lossless to it, not to the bfloat16 reference.
    """
    check_variants([Variant(f"int{bits}")], target.dtype, target.device)
    copy = LoadedModel(
        shared_copy(target.model), target.tokenizer, target.name, dict(target.extra), target.kernel
    )
    spec = ModelSpec(target.name, f"int{bits}")  # type: ignore[arg-type]
    return quantize_loaded(copy, spec, keep_weights=False, role="target")


def make_variant(
    reference: LoadedModel, variant: Variant, calibration: list[list[int]] | None = None
) -> tuple[LoadedModel, dict[str, Any]]:
    """`variant` of the reference target, and what was chosen (for the report). Pruned variants
    need `calibration` (token-id sequences); the reference itself is left as it was."""
    check_fits(variant, reference)
    if variant.bits:
        return quantized_target(reference, variant.bits), {}
    if not calibration:
        raise ValueError(f"{variant} needs calibration text (no sequences given)")
    model = reference.model
    info: dict[str, Any] = {"calibration_sequences": len(calibration)}
    info["calibration_tokens"] = sum(len(ids) for ids in calibration)
    if variant.kind == "drop-layers":
        scores = prune.block_influence(model, calibration)
        dropped = prune.least_influence(scores, int(variant.value))  # type: ignore[arg-type]
        pruned = prune.shared_copy(model)
        prune.drop_layers(pruned, dropped)
        info.update(
            block_influence=scores, dropped_layers=dropped, layers=len(scores) - len(dropped)
        )
    else:
        width = model.config.intermediate_size
        keep = prune.kept_channels(width, float(variant.value))  # type: ignore[arg-type]
        scores = prune.mlp_channel_scores(model, calibration)
        pruned = prune.shared_copy(model)
        prune.prune_mlp(pruned, [prune.top_channels(s, keep) for s in scores])
        info.update(intermediate_size=keep, original_intermediate_size=width)
        info["removed_fraction"] = 1.0 - keep / width
    loaded = LoadedModel(pruned, reference.tokenizer, f"{reference.name}:{variant}")
    loaded.kernel = reference.kernel
    return loaded, info


# -- calibration text -------------------------------------------------------------------------


def calibration_sequences(
    target: LoadedModel,
    prompts: list[BenchPrompt],
    max_new_tokens: int,
    chat: bool = True,
    cache: Path | None = None,
    progress: bool = True,
) -> list[list[int]]:
    """Each prompt's ids followed by the target's greedy answer (`max_new_tokens` at most), read
    from `cache` (a folder) when it holds them for this model and these settings, else computed
    and written there."""
    engine = SpeculativeDecoder(target, generation_config="none")
    inputs = [engine.encode_prompt(p.turns[0], chat=chat) for p in prompts]
    key = _calibration_key(target, inputs, max_new_tokens)
    path = None
    if cache is not None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cache) / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', target.name)}-{digest}.json"
        saved = _read_cached(path, key)
        if saved is not None:
            return saved
    sequences = []
    for ids in tqdm(inputs, desc="calibration text", unit="prompt", disable=not progress):
        answer = engine.generate(ids, max_new_tokens=max_new_tokens, temperature=0.0).token_ids
        sequences.append([*ids, *answer])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        partial.write_text(json.dumps({"key": key, "sequences": sequences}))
        partial.replace(path)  # atomic: a reader never sees half a file
    return sequences


def calibration_cache() -> Path:
    """Where calibration text is cached: `calibration/` in the models' cache folder."""
    return cache_dir() / "calibration"


def _calibration_key(target: LoadedModel, inputs: list[list[int]], max_new_tokens: int) -> dict:
    """What the cached answers depend on: the model (name, config, a checksum of its first
    weights), how it runs (dtype, kernel) and the prompts' ids and answer length."""
    config = target.model.config.to_json_string(use_diff=False)
    first = next(target.model.parameters()).detach().flatten()[:4096]
    return {
        "version": CALIBRATION_VERSION,
        "model": target.name,
        "config": hashlib.sha256(config.encode()).hexdigest()[:16],
        "weights": f"{float(first.double().sum()):.9e}",
        "dtype": str(target.dtype),
        "kernel": target.kernel,
        "prompts": hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16],
        "max_new_tokens": max_new_tokens,
    }


def _read_cached(path: Path, key: dict) -> list[list[int]] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    sequences = data.get("sequences")
    if not isinstance(sequences, list) or not all(isinstance(s, list) for s in sequences):
        return None
    return [[int(t) for t in s] for s in sequences]
