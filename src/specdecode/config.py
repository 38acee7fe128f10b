"""A run configuration file: which models, which drafter, how many tokens to draft, and how.

One JSON object; every key is optional (a run still needs a target from somewhere:
`specdecode generate --config FILE` takes the file's values as defaults, explicit flags win):

    {
      "target": "qwen2.5-coder-1.5b-instruct",
      "draft": "qwen2.5-coder-0.5b-instruct",
      "k": 4, "k_policy": "cost", "confidence": null, "tree": null,
      "dtype": "bfloat16", "device": null,
      "per_category": {"code": {"k": 6}, "chat": {"draft": "ngram:1-3", "k": 2}}
    }

`target` takes what `--target` takes: a model, `MODEL:int8` / `MODEL:int4` for int8 / 4-bit
weights (the model then reproduced). `draft` takes what `--draft` takes: a model (`MODEL:int8` / `MODEL:int4` for int8 / 4-bit
weights), `early-exit:N` or `ngram[:MIN-MAX]`; null (the default) is autoregressive. `k` is the
fixed k, the heuristic's starting k or the cost policy's k_max (policies.py). `tree`
(`static:3,2,1` / `dynamic:NODES[,DEPTH,WIDTH[,FLOOR[,LEAF]]]`, drafters/tree_shape.py) drafts a
token tree instead of a chain; it needs a model draft, and k is then unused.

`per_category` holds a tuner's overrides per prompt category (only the keys in
`CATEGORY_KEYS`); `RunConfig.for_category(name)` applies them. The server and the bench read
the same file through `load_config`. `to_vllm_speculative_config` exports the drafting part as
vLLM's `speculative_config`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.core.draft_spec import DraftSpec, ModelSpec
from specdecode.core.policies import K_POLICIES
from specdecode.drafters.model import check_confidence
from specdecode.drafters.suffix import MAX_MATCH
from specdecode.drafters.tree_shape import parse_tree_spec
from specdecode.models.fetch import cached_path
from specdecode.models.presets import PRESETS

# what a tuner may set per category
CATEGORY_KEYS = ("draft", "k", "k_policy", "confidence", "tree")


@dataclass
class RunConfig:
    """Validated on construction: ValueError with the offending key on a bad value."""

    target: str | None = None  # preset, local folder, .gguf or hub id, [:int8|:int4]
    draft: str | None = None  # None = autoregressive
    k: int = 4  # fixed k / heuristic's starting k / cost's k_max
    k_policy: str = "cost"  # one of policies.K_POLICIES
    confidence: float | None = None  # stop a model draft below this top probability
    tree: str | None = None  # a token-tree shape for a model draft; None = a chain
    dtype: str = "bfloat16"
    device: str | None = None  # None: cuda if present
    per_category: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("target", "draft", "device"):
            _check_optional_str(key, getattr(self, key))
        if self.target is not None:
            ModelSpec.parse(self.target, "target")  # `MODEL[:int8|:int4]`
        _check_draft(self.draft)
        if not isinstance(self.dtype, str):
            raise ValueError(f"dtype must be a string (got {self.dtype!r})")
        _check_drafting(self.__dict__)
        _check_tree(self.draft, self.tree, self.confidence)
        if not isinstance(self.per_category, dict):
            raise ValueError("per_category must be an object of {category: {key: value}}")
        for name, overrides in self.per_category.items():
            if not isinstance(overrides, dict):
                raise ValueError(f"per_category[{name!r}] must be an object")
            _check_keys(overrides, CATEGORY_KEYS, f"per_category[{name!r}]")
            _check_drafting(overrides, where=f"per_category[{name!r}].")
            if "draft" in overrides:
                _check_optional_str(f"per_category[{name!r}].draft", overrides["draft"])
                _check_draft(overrides["draft"], where=f"per_category[{name!r}].")
            merged = {**self.__dict__, **overrides}  # what the category runs
            _check_tree(
                merged["draft"], merged["tree"], merged["confidence"], f"per_category[{name!r}]."
            )

    @property
    def draft_spec(self) -> DraftSpec | None:
        """`draft` parsed (None: autoregressive)."""
        return None if self.draft is None else DraftSpec.parse(self.draft)

    def for_category(self, category: str | None) -> RunConfig:
        """What one category runs: `per_category[category]` applied (nothing for an unknown one
        or None), and no per_category left, whose entries were relative to this config."""
        overrides = self.per_category.get(category, {}) if category is not None else {}
        return dataclasses.replace(self, **overrides, per_category={})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        if not isinstance(data, dict):
            raise ValueError("a run config is a JSON object")
        _check_keys(data, [f.name for f in dataclasses.fields(cls)], "run config")
        return cls(**data)


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a JSON run config (ValueError on a missing file or a bad value)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"config file {path} not found") from None
    except OSError as err:
        raise ValueError(f"cannot read config file {path}: {err.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    try:
        return RunConfig.from_dict(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def save_config(config: RunConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


def to_vllm_speculative_config(config: RunConfig) -> dict[str, Any]:
    """The drafting part of `config` as vLLM's `speculative_config` (`vllm serve TARGET
    --speculative-config '<json>'`).

    A model draft -> {"method": "draft_model", "model": ..., "num_speculative_tokens": k};
    `ngram:MIN-MAX` -> {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min":
    MIN, "prompt_lookup_max": MAX}; `suffix[:OPTIONS]` -> vLLM's suffix decoding, {"method":
    "suffix", "num_speculative_tokens": depth, "suffix_decoding_max_tree_depth": the longest
    match plus depth, "suffix_decoding_max_spec_factor": factor,
    "suffix_decoding_min_token_prob": min-prob}, and "suffix_decoding_max_cached_requests": 0
    for `pool=off` (vLLM bounds its pool in requests, not tokens: its own default otherwise).
    A hybrid has no vLLM equivalent (one method per engine). vLLM drafts a fixed number of
    tokens, so an adaptive
    policy exports its k (the largest it would try) and `confidence` is not exported; a
    `MODEL:int8` or `MODEL:int4` draft exports MODEL; `eagle3:DIR` exports {"method":
    "eagle3", "model": DIR, ...} (vLLM reads the layout `distill --kind eagle` writes). A preset
    exports the folder it was
    converted to (fetch it first). ValueError for no draft, for early-exit drafts and for token
    trees, which vLLM's draft-model method has no equivalent of.
    """
    draft = config.draft
    if draft is None:
        raise ValueError("the config has no draft: nothing to export to vLLM")
    if config.tree is not None:
        raise ValueError(
            f"vLLM's draft-model and n-gram methods draft a chain, not a token tree ({config.tree})"
        )
    spec = DraftSpec.parse(draft)
    if spec.kind == "early-exit":
        raise ValueError(f"vLLM has no early-exit (self-speculative) drafting: {draft!r}")
    if spec.kind == "distilled":
        raise ValueError(
            f"{draft!r}: a distilled draft is an adapter merged at load time, which vLLM's "
            "draft-model method does not load; export the base draft, or merge and save it first"
        )
    if spec.kind == "hybrid":
        raise ValueError(
            f"{draft!r}: vLLM runs one speculative method per engine, not a model and suffix "
            "decoding in turns; export the model or `suffix` alone"
        )
    if spec.kind == "suffix":
        options = spec.suffix
        exported: dict[str, Any] = {
            "method": "suffix",
            "num_speculative_tokens": options.depth,
            "suffix_decoding_max_tree_depth": MAX_MATCH + options.depth,
            "suffix_decoding_max_spec_factor": options.factor,
            "suffix_decoding_min_token_prob": options.min_prob,
        }
        if not options.pool:
            exported["suffix_decoding_max_cached_requests"] = 0
        return exported
    if spec.kind == "ngram":
        low, high = spec.ngram
        return {
            "method": "ngram",
            "num_speculative_tokens": config.k,
            "prompt_lookup_min": low,
            "prompt_lookup_max": high,
        }
    if spec.kind == "eagle":  # the head's folder, in the speculators layout vLLM reads
        return {
            "method": "eagle3",
            "model": spec.model.name,  # type: ignore[union-attr]
            "num_speculative_tokens": config.k,
        }
    # a quantized draft exports its model: int8 / int4 are our CPU kernel's, vLLM picks its own
    return {
        "method": "draft_model",
        "model": vllm_model(spec.model.name),
        "num_speculative_tokens": config.k,
    }


def vllm_model(spec: str) -> str:
    """A model vLLM can load: presets become their converted folder."""
    if spec not in PRESETS:
        return spec

    folder = cached_path(spec)
    if folder is None:
        raise ValueError(
            f"{spec} is a specdecode preset: run `specdecode models fetch {spec}` first, then "
            "vLLM loads the converted folder"
        )
    return str(folder)


# -- validation ------------------------------------------------------------------------------


def _check_keys(data: dict[str, Any], allowed: Any, where: str) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown key(s) in {where}: {', '.join(unknown)} (allowed: {', '.join(allowed)})"
        )


def _check_optional_str(key: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null (got {value!r})")


def _check_draft(draft: str | None, where: str = "") -> None:
    """A draft the command line would take (draft_spec.py), or None."""
    if draft is None:
        return
    try:
        DraftSpec.parse(draft)
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None


def _check_tree(draft: Any, tree: Any, confidence: Any, where: str = "") -> None:
    """A tree needs a parseable shape and a model draft (a model or early-exit:N); its width,
    not a confidence cut, bounds what it drafts."""
    if tree is None:
        return
    if not isinstance(tree, str):
        raise ValueError(f"{where}tree must be a string or null (got {tree!r})")

    try:
        parse_tree_spec(tree)
    except ValueError as err:
        raise ValueError(f"{where}{err}") from None
    if draft is None or not DraftSpec.parse(draft).drafts_trees:
        raise ValueError(
            f"{where}tree needs a model draft (a model, early-exit:N or eagle3:DIR), not {draft!r}; "
            "`--tree none` drafts a chain instead"
        )
    if confidence is not None:
        raise ValueError(f"{where}confidence applies to chains, not to a tree ({tree})")


def _check_drafting(values: dict[str, Any], where: str = "") -> None:
    """k, k_policy and confidence, where present in `values`."""
    if "k" in values:
        k = values["k"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{where}k must be an integer >= 1 (got {k!r})")
    if "k_policy" in values and values["k_policy"] not in K_POLICIES:
        raise ValueError(
            f"{where}k_policy must be one of {', '.join(K_POLICIES)} (got {values['k_policy']!r})"
        )
    if "confidence" in values:
        try:
            check_confidence(values["confidence"])
        except ValueError as err:
            raise ValueError(f"{where}{err}") from None
