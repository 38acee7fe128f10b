"""A distillation's adapter as a draft model reads it: DIR/distill.json (what it was trained for,
on and with) checked against DIR/adapter (peft's `save_pretrained`), then merged into the base
draft's weights (distill/result.py writes them).

Reading (`read_result`) needs distill.json and an adapter whose hash matches it: an interrupted
write, a temporary folder or a changed adapter is refused. Loading (`merge_adapter`, called by
`load_model(..., adapter=...)` before the kernel and any quantization): the base draft's config
must be the one trained (model type and shapes), then the adapter is merged into its weights
(peft's `merge_and_unload`): the draft is a plain model again, which the lean forward, the kernels
and `:int8` / `:int4` run unchanged. peft is optional (`specdecode[distill]`): imported on use.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from specdecode.models.fetch import sha256_file
from specdecode.models.files import load_json

RECORD, ADAPTER, PARTIAL = "distill.json", "adapter", ".adapter.partial"
WEIGHTS = "adapter_model.safetensors"
FORMAT = 1
# the draft config fields an adapter's shapes depend on
CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def draft_fingerprint(model: Any) -> dict[str, Any]:
    config = model.config
    return {name: getattr(config, name, None) for name in CONFIG_FIELDS}


def vocab_digest(tokenizer: Any) -> str | None:
    """A hash of a tokenizer's vocabulary (token -> id), or None without one."""
    if tokenizer is None:
        return None
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def peft_modules() -> Any:
    try:
        import peft  # optional: specdecode[distill]
    except ImportError:
        raise ValueError(
            "distillation trains LoRA adapters with peft, which is not installed: "
            "pip install 'specdecode[distill]' (or pip install peft)"
        ) from None
    return peft


@contextlib.contextmanager
def quiet_peft() -> Any:
    """peft asks transformers 5 for a deprecated attribute, a FutureWarning per model."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        yield


def read_result(folder: str | Path) -> dict[str, Any]:
    """DIR/distill.json, checked against DIR/adapter; ValueError naming what is wrong."""
    out = Path(folder).expanduser()
    record_path, adapter = out / RECORD, out / ADAPTER
    if not out.is_dir():
        raise ValueError(f"distilled draft {folder}: no such folder")
    if not record_path.is_file():
        unfinished = (out / PARTIAL).exists() or (out / "checkpoints").exists()
        hint = (
            "an unfinished distillation: run the same `specdecode distill` command again to "
            "finish it"
            if unfinished
            else "write one with `specdecode distill --out DIR`"
        )
        raise ValueError(f"distilled draft {folder}: no {RECORD} ({hint})")
    try:
        record = load_json(record_path)
    except ValueError as err:
        raise ValueError(f"distilled draft {folder}: {RECORD} is not JSON ({err})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or "draft" not in record:
        raise ValueError(f"distilled draft {folder}: {RECORD} is not a distillation record")
    weights = adapter / WEIGHTS
    if not weights.is_file():
        raise ValueError(f"distilled draft {folder}: {weights} is missing")
    if sha256_file(weights) != record["adapter"]["sha256"]:
        raise ValueError(
            f"distilled draft {folder}: {weights} is not the adapter {RECORD} records (changed "
            "or half-written): run `specdecode distill` again"
        )
    return record


def merge_adapter(model: Any, folder: str | Path) -> Any:
    """`model` (the base draft, loaded) with DIR's adapter merged into its weights: the same
    model class, no peft wrapper left. ValueError if it is not the draft the adapter was trained
    on."""
    record = read_result(folder)
    held, have = record["draft_config"], draft_fingerprint(model)
    differ = [k for k in CONFIG_FIELDS if held.get(k) != have.get(k)]
    if differ:
        raise ValueError(
            f"distilled draft {folder}: its adapter was trained on {record['draft']} with "
            + ", ".join(f"{k}={held.get(k)}" for k in differ)
            + ", but that model now has "
            + ", ".join(f"{k}={have.get(k)}" for k in differ)
        )
    peft = peft_modules()
    with quiet_peft():
        wrapped = peft.PeftModel.from_pretrained(model, str(Path(folder).expanduser() / ADAPTER))
        return wrapped.merge_and_unload().eval()


def check_target(
    record: dict[str, Any], folder: str, target: Any, what: str = "distilled draft"
) -> None:
    """The tokenizers of the target and the distilled draft must match (ValueError); a target
    other than the one distilled for is a note on stderr (still lossless, the gain unmeasured)."""
    if target is None:
        return
    tokenizer = getattr(target, "tokenizer", None)
    held = record.get("tokenizer")
    if tokenizer is not None and held is not None and vocab_digest(tokenizer) != held:
        raise ValueError(
            f"{what} {folder}: the target's tokenizer is not the one it was distilled "
            f"with (for {record['target']}): a draft must share its target's tokenizer"
        )
    name = getattr(target, "name", None)
    if name is not None and _base_name(str(name)) != _base_name(str(record["target"])):
        print(
            f"note: {what} {folder} was trained for {record['target']}, drafting for "
            f"{name} (still lossless: the target verifies every token)",
            file=sys.stderr,
        )


def _base_name(spec: str) -> str:
    """A model's name as LoadedModel.name has it (a folder's last part), its :int8 / :int4
    dropped."""
    head, _, suffix = spec.rpartition(":")
    name = head if suffix in ("int8", "int4") else spec
    return os.path.basename(name.rstrip("/"))
