"""`load_model`: one entry point for every way a model reaches specdecode.

A spec is resolved in this order: an offline preset name, a `.gguf` file, a local folder saved with
`save_pretrained`, and last a Hugging Face hub id (used as is). Any of them may end in `:int8` or
`:int4` (`ModelSpec`, draft_spec.py): the model then runs its linears on int8 / 4-bit weights
(models/quantized.py).
"""

from __future__ import annotations

import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from specdecode.core.draft_spec import ModelSpec
from specdecode.kernels.cpu_linear import apply_kernel, resolve_mode
from specdecode.kernels.quantize import drop_pages
from specdecode.models import presets
from specdecode.models.adapters import merge_adapter
from specdecode.models.device import resolve_device, resolve_dtype
from specdecode.models.draft_vocab import restrict_draft_vocab
from specdecode.models.fetch import fetch_preset
from specdecode.models.gguf_int4 import codes_file, write_codes
from specdecode.models.quantized import check_quantizable, quantize_loaded, reads_file_codes


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with its tokenizer when it has one."""

    model: Any  # transformers.PreTrainedModel, in eval mode
    tokenizer: Any | None = None  # transformers tokenizer, or None for models saved without one
    name: str = "model"
    extra: dict[str, Any] = field(default_factory=dict)
    # what its linear layers run on: "eager" (PyTorch) or a kernel name (kernels/cpu.py), e.g.
    # "bf16-avx2" / "bf16-avx512" (the panels on AVX2 FMAs / AVX-512 BF16), "int4-avx512vnni"
    kernel: str = "eager"

    @property
    def device(self) -> torch.device:
        return _first_parameter(self.model).device

    @property
    def dtype(self) -> torch.dtype:
        return _first_parameter(self.model).dtype


def _first_parameter(model: Any) -> torch.Tensor:
    """The model's first parameter that holds data (a quantized target's freed weights are on the
    meta device: kernels/quantize.py `free_weight`)."""
    first = None
    for param in model.parameters():
        if not param.is_meta:
            return param
        first = first if first is not None else param
    if first is None:
        raise ValueError("the model has no parameters")
    return first


def wrap_model(model: Any, tokenizer: Any | None = None, name: str | None = None) -> LoadedModel:
    """Wrap an already-built transformers model (used by tests and by callers who load themselves)."""
    if isinstance(model, LoadedModel):
        return model
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name or type(model).__name__)


def _load_folder(
    folder: Path, dtype: torch.dtype, device: torch.device, gguf_file: str | None = None
):
    # slow import (transformers' model classes, ~1.5 s): models/ is imported by the command
    # line's parser; transformers only when a model is loaded
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if gguf_file is not None:
        from transformers import GgufConfig  # slow import, as above

        # dequantize into plain tensors: nothing of the GGUF quantizer stays attached
        kwargs = {"gguf_file": gguf_file, "quantization_config": GgufConfig(dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            folder, **({"gguf_file": gguf_file} if gguf_file else {})
        )
    except (OSError, ValueError, TypeError):
        tokenizer = None  # saved without a tokenizer: callers pass token ids
    return model, tokenizer


def load_model(
    spec: str | Path | ModelSpec,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device | None = None,
    kernel: str | None = None,
    *,
    keep_weights: bool = False,
    role: str = "model",
    adapter: str | Path | None = None,
    draft_vocab: int | None = None,
) -> LoadedModel:
    """Load a causal LM from a preset name, a `.gguf` file, a local folder or a hub id, each
    optionally with `:int8` / `:int4`.

    Default dtype is bfloat16 (faster than float32 on CPU for these models: docs/results.md);
    exact-identity tests use float32. `kernel` ("auto", "on", "off"; None: $SPECDECODE_KERNEL,
    else "auto") puts a bfloat16 model's linear layers on the CPU kernels (`specdecode.kernels`).
    `MODEL:int8` / `MODEL:int4` runs them on int8 / 4-bit weights (bfloat16 on an AVX2 CPU only,
    kernel not off: ValueError before loading otherwise) and names the model `MODEL:int4`; its
    bfloat16 weights are freed unless `keep_weights` (a draft in training; models/quantized.py).
    `role` ("target", "draft") names the model in error messages. `adapter`: a distillation's folder
    (`specdecode distill --out DIR`) whose adapter is merged into the weights first, so that the
    kernel and the quantization take the trained weights (models/adapters.py). `draft_vocab`:
    a draft's output layer keeps only that many ids (and the special ones) where it has more
    (models/draft_vocab.py); None keeps them all.
    """
    model_spec = spec if isinstance(spec, ModelSpec) else ModelSpec.parse(str(spec), role)
    # a bad mode, and a quantization that cannot run, fail before anything is loaded
    mode = resolve_mode(kernel)
    check_quantizable(model_spec, dtype, device, mode, role)
    # a target's `:int4` of a preset reads the GGUF's own codes: its fetch keeps the file
    keep_gguf = reads_file_codes(model_spec, role)
    loaded = _load(model_spec.name, dtype, device, keep_gguf=keep_gguf)
    if adapter is not None:
        loaded.model = merge_adapter(loaded.model, adapter)
    restrict_draft_vocab(loaded, draft_vocab)  # before the kernel and quantization take the layer
    if model_spec.quantization is None or keep_weights:
        loaded.kernel = apply_kernel(loaded.model, mode)
        return quantize_loaded(loaded, model_spec, keep_weights=keep_weights, role=role)
    # bfloat16 weights about to be freed: quantized first, so that none is packed into the
    # bfloat16 kernel's panels (a written copy of it) only to be dropped
    quantize_loaded(loaded, model_spec, keep_weights=False, role=role, release_pages=True)
    apply_kernel(loaded.model, mode)  # the attention kernel, and any linear left in bfloat16
    own_memory(loaded.model)
    return loaded


def own_memory(model: torch.nn.Module) -> None:
    """Give each parameter that holds data its own copy of it.

    transformers maps a safetensors file into memory (copy-on-write) and makes the parameters
    views of that mapping; a page of it read or written stays in the process as long as any
    view lives. Once a quantized model's bfloat16 weights are freed, its embedding, norms and
    biases are the views left: copied out, the whole mapping goes, and the process holds what
    the model holds (docs/results.md). (A bfloat16 model keeps its
    mapping: the kernel's panels are written into its pages, kernels/panels.py `pack`.) For a
    model just loaded: nothing outside it may share its tensors."""
    # a storage that two tensors view stays as it is (copying each would untie them); a tied
    # Parameter is one tensor under two names
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    views = Counter(t.untyped_storage().data_ptr() for t in tensors.values())
    shared = {ptr for ptr, count in views.items() if count > 1}
    with torch.no_grad():
        for param in model.parameters():  # each once (a tied Parameter is one object)
            if not param.is_meta and param.untyped_storage().data_ptr() not in shared:
                loaded = param.data
                param.data = loaded.clone()
                drop_pages(loaded)  # not held twice until the mapping goes


def _load(
    spec: str | Path,
    dtype: str | torch.dtype,
    device: str | torch.device | None,
    keep_gguf: bool = False,
) -> LoadedModel:
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    spec_str = str(spec)
    path = Path(spec_str).expanduser()

    if spec_str in presets.PRESETS:
        # a folder failing the size check is fetched again
        keep = partial(write_codes, dest=codes_file(spec_str)) if keep_gguf else None
        folder = fetch_preset(spec_str, on_gguf=keep)
        model, tokenizer = _load_preset_folder(spec_str, folder, torch_dtype, dev)
        # `preset` / `gguf`: where `:int4` finds the file's own 4-bit codes (models/quantized.py)
        return LoadedModel(model, tokenizer, name=spec_str, extra={"preset": spec_str})

    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model file {spec_str!r} does not exist")
        model, tokenizer = _load_folder(path.parent, torch_dtype, dev, gguf_file=path.name)
        return LoadedModel(model, tokenizer, name=path.stem, extra={"gguf": path})

    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model folder {spec_str!r} has no config.json (save it with save_pretrained)"
            )
        model, tokenizer = _load_folder(path, torch_dtype, dev)
        return LoadedModel(model, tokenizer, name=path.name)

    looks_like_path = spec_str.startswith((".", "/", "~")) or spec_str.count("/") > 1
    if looks_like_path or path.exists():
        raise ValueError(f"model path {spec_str!r} does not exist")
    return _load_hub_id(spec_str, torch_dtype, dev)


def _load_preset_folder(name: str, folder: Path, dtype: torch.dtype, device: torch.device):
    """`_load_folder` for a cached preset: a file that reads back wrong (its size was right, see
    fetch.py) is a ValueError naming the folder, not a traceback from inside transformers."""
    try:
        return _load_folder(folder, dtype, device)
    except (MemoryError, torch.cuda.OutOfMemoryError):
        raise  # the machine, not the files
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"the cached preset {name} in {folder} could not be loaded "
            f"({type(err).__name__}: {reason}): check it with `specdecode models verify {name}`, "
            f"or remove the folder and run `specdecode models fetch {name}`"
        ) from err


# how long the hub's host may take to accept a connection before a hub id is refused: a machine
# without the hub learns it in seconds, not through a minute of the hub client's retries
HUB_PROBE_TIMEOUT_S = 3.0


def _load_hub_id(hub_id: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    problem = hub_problem(hub_id)
    if problem is None:
        try:
            model, tokenizer = _load_folder(hub_id, dtype, device)  # type: ignore[arg-type]
            return LoadedModel(model, tokenizer, name=hub_id)
        except OSError as err:
            problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise ValueError(
        f"could not load {hub_id!r}: it is not a local path, and the Hugging Face hub did not "
        f"provide it ({problem}). Without the hub, use a preset: {', '.join(presets.PRESETS)}"
    )


def hub_problem(hub_id: str, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Why the hub cannot provide `hub_id` now, found within `timeout_s`: offline mode, or no
    connection to the hub's host; None where its config is in the local cache (transformers
    loads it from there) or the host accepts a connection (the hub client then says the rest)."""
    # slow import (huggingface_hub, ~0.3 s): only for a hub id
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "offline mode: HF_HUB_OFFLINE is set, and it is not in the local cache"
    url = urlsplit(constants.ENDPOINT)
    host, port = url.hostname or "", url.port or (443 if url.scheme == "https" else 80)
    outcome: list[BaseException | None] = []

    def connect() -> None:  # in a thread: a slow name lookup has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(err)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout_s)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    if outcome[0] is not None:
        return f"cannot reach {host}:{port}: {outcome[0]}"
    return None
