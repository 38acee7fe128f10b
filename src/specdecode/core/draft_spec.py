"""The `--draft` text, parsed once: `MODEL`, `MODEL:int8`, `MODEL:int4`, `ngram`, `ngram:MIN-MAX`,
`suffix[:OPTIONS]` (suffix drafting over the request and earlier outputs, drafters/suffix.py;
OPTIONS as `SuffixOptions` reads them), `MODEL+suffix[:OPTIONS]` (a hybrid: each step the model's
chain or the suffix's tree, whichever is worth more; drafters/hybrid.py), `early-exit:N`, `distilled:DIR[:int8|:int4]` (a draft trained for its target by
`specdecode distill`: DIR/distill.json names the base draft, DIR/adapter holds what it learnt) or
`eagle3:DIR[:int8|:int4]` (an EAGLE-3 head over the target's hidden states, as published or
trained by `specdecode distill --kind eagle`: DIR/config.json and DIR/model.safetensors;
`eagle:DIR` is the same).

No heavy imports (no torch, no transformers), so the command line and the run config check a
draft before any model is loaded. `drafters.resolve_draft` builds the drafter from a DraftSpec.
`ModelSpec` is the model part on its own (`MODEL[:int8|:int4]`): what `--target` and `load_model`
take, so that a target carries the same quantization suffix.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal

Quantization = Literal["int8", "int4"]
DraftKind = Literal["model", "ngram", "suffix", "hybrid", "early-exit", "distilled", "eagle"]

# MODEL:int8 runs its linears on int8 weights; MODEL:int4 on 4-bit weights (groups of 32, a tied
# output layer int8); both on the CPU kernel, for a draft or a target (models/quantized.py)
QUANT_BITS: dict[str, int] = {"int8": 8, "int4": 4}
DEFAULT_NGRAM = (1, 3)  # `ngram` alone: n-grams of 1 to 3 tokens
# the ids a draft model's output layer keeps by default (models/draft_vocab.py);
# $SPECDECODE_DRAFT_VOCAB or --draft-vocab overrides it, 0 or "all": every id
DEFAULT_DRAFT_VOCAB = 65536
DRAFT_VOCAB_ENV = "SPECDECODE_DRAFT_VOCAB"

MODEL_FORMS = "expected MODEL, MODEL:int8 or MODEL:int4 (int8 / 4-bit weights)"
DRAFT_FORMS = (
    "a draft is MODEL, MODEL:int8, MODEL:int4, ngram, ngram:MIN-MAX, suffix[:OPTIONS], "
    "MODEL+suffix[:OPTIONS], early-exit:N, distilled:DIR[:int8|:int4] or "
    "eagle3:DIR[:int8|:int4] "
    "(e.g. qwen2.5-coder-0.5b-instruct:int4, ngram:1-3, suffix, suffix:depth=8,pool=off, "
    "qwen2.5-coder-0.5b-instruct:int4+suffix, early-exit:8, distilled:runs/distill:int4, "
    "eagle3:runs/eagle:int4)"
)
SUFFIX = "suffix"
HYBRID = "+suffix"  # what joins a model and the suffix drafter in a hybrid's spec
DISTILLED = "distilled:"  # the prefix of a distilled draft's spec
EAGLE = "eagle3:"  # the prefix of an EAGLE-3 head's spec
_FOLDER_KINDS = {"distilled": DISTILLED, "eagle": EAGLE}  # kinds named by a trained folder
_ALIASES = {"eagle:": "eagle"}  # other prefixes of a folder kind (read, never printed)

_NUMBER = re.compile(r"[0-9]+")  # ASCII only: str.isdigit() also takes '²', which int() refuses
_LOOKS_QUANTIZED = re.compile(r"(?i)(int|q|fp|bf)[0-9]+\w*")  # `:int2`, `:INT8`, `:q4_0`, `:fp8`


# the draft spec of our proposers inside vLLM (integrations/vllm.py), which vLLM builds with its
# own config only: `tune --engine vllm` sets it per candidate
VLLM_DRAFT_ENV = "SPECDECODE_VLLM_DRAFT"


@dataclass(frozen=True)
class ModelSpec:
    """A model and the weights it runs on: `name` is a preset, local folder, .gguf or hub id;
    `quantization` None (the --dtype weights), "int8" or "int4"."""

    name: str
    quantization: Quantization | None = None

    def __post_init__(self) -> None:
        problem = _name_problem(self.name)
        if problem:
            raise ValueError(f"bad model name {self.name!r}: {problem}; {MODEL_FORMS}")
        if self.quantization is not None and self.quantization not in QUANT_BITS:
            raise ValueError(f"bad model quantization {self.quantization!r}: {MODEL_FORMS}")

    @property
    def bits(self) -> int | None:
        """Weight bits of a quantized model (8 or 4); None for the --dtype weights."""
        return QUANT_BITS[self.quantization] if self.quantization else None

    def __str__(self) -> str:
        return f"{self.name}:{self.quantization}" if self.quantization else self.name

    @classmethod
    def parse(cls, text: str, what: str = "model") -> ModelSpec:
        """`MODEL`, `MODEL:int8` or `MODEL:int4` -> ModelSpec (ValueError if bad); `what` names
        the option in the message ("model", "draft", "target")."""
        name, quantization = _split_quantization(text)
        problem = _name_problem(name)
        if problem:
            raise ValueError(f"bad {what} {text!r}: {problem}; {MODEL_FORMS}")
        return cls(name, quantization)  # type: ignore[arg-type]


def _split_quantization(text: str) -> tuple[str, str | None]:
    """ "MODEL:int8" -> ("MODEL", "int8"), "MODEL:int4" likewise, anything else -> (text, None)."""
    name, sep, suffix = text.rpartition(":")
    return (name, suffix) if sep and suffix in QUANT_BITS else (text, None)


def _name_problem(name: str) -> str | None:
    """Why `name` cannot be a model's name (once its quantization is split off), or None."""
    if not name:
        return "no model name"
    last = name.rpartition(":")[2] if ":" in name else ""
    if last in QUANT_BITS:
        return "one quantization at most"
    if _LOOKS_QUANTIZED.fullmatch(last):  # a mistyped quantization, not part of a name
        return f"unknown quantization {last!r}"
    return None


@dataclass(frozen=True)
class SuffixOptions:
    """The suffix drafter's limits (drafters/suffix.py), written `suffix:KEY=VALUE,...`:
    `depth` (deepest tree level), `nodes` (most nodes per tree), `factor` (nodes per matched
    token: a short match drafts a small tree), `min-prob` (the least share of the votes a node
    needs), `pool` (`on`: earlier outputs are drafted from too; `off`: this request only) and
    `pool-tokens` (the pool's size; the oldest outputs are evicted first)."""

    depth: int = 16
    nodes: int = 32
    factor: float = 4.0
    min_prob: float = 0.1
    pool: bool = True
    pool_tokens: int = 65536

    def __post_init__(self) -> None:
        problem = _suffix_problem(self)
        if problem:
            raise ValueError(f"bad suffix options: {problem}")

    def __str__(self) -> str:
        given = []
        for key, value in self._items():
            if value != getattr(SuffixOptions, key.replace("-", "_")):
                text = ("on" if value else "off") if isinstance(value, bool) else f"{value:g}"
                given.append(f"{key}={text}")
        return SUFFIX + (":" + ",".join(given) if given else "")

    def _items(self) -> list[tuple[str, int | float | bool]]:
        return [(key, getattr(self, key.replace("-", "_"))) for key in _SUFFIX_KEYS]

    @classmethod
    def parse(cls, text: str) -> SuffixOptions:
        """`suffix` or `suffix:KEY=VALUE,...` -> SuffixOptions (ValueError naming the keys)."""
        head, sep, rest = text.partition(":")
        if head != SUFFIX or (sep and not rest):
            raise ValueError(f"bad suffix draft {text!r}: {SUFFIX_FORMS}")
        values: dict[str, object] = {}
        for item in rest.split(",") if rest else []:
            key, eq, value = item.strip().partition("=")
            if not eq or key not in _SUFFIX_KEYS:
                raise ValueError(f"bad suffix option {item!r} in {text!r}: {SUFFIX_FORMS}")
            values[key.replace("-", "_")] = _suffix_value(key, value.strip(), text)
        return cls(**values)  # type: ignore[arg-type]


_SUFFIX_KEYS = ("depth", "nodes", "factor", "min-prob", "pool", "pool-tokens")
SUFFIX_FORMS = (
    "suffix or suffix:KEY=VALUE,... with keys depth, nodes, pool-tokens (integers >= 1; "
    "pool-tokens >= 0), factor (> 0), min-prob (0 to 1), pool (on or off), e.g. "
    "suffix:depth=8,pool=off"
)


def _suffix_value(key: str, value: str, text: str) -> int | float | bool:
    try:
        if key == "pool":
            if value not in ("on", "off"):
                raise ValueError(value)
            return value == "on"
        if key in ("factor", "min-prob"):
            return float(value)
        if not _NUMBER.fullmatch(value):
            raise ValueError(value)
        return int(value)
    except ValueError:
        raise ValueError(f"bad suffix option {key}={value!r} in {text!r}: {SUFFIX_FORMS}") from None


def _suffix_problem(o: SuffixOptions) -> str | None:
    if o.depth < 1 or o.nodes < 1 or o.pool_tokens < 0:
        return "depth and nodes need >= 1, pool-tokens >= 0"
    if not 0 < o.factor < float("inf") or not 0 <= o.min_prob <= 1:
        return "factor needs > 0 and min-prob 0 to 1"
    return None


@dataclass(frozen=True)
class DraftSpec:
    """What drafts: `kind` "model" (`model` set), "ngram" (`ngram` = (MIN, MAX) n-gram sizes),
    "early-exit" (`depth` = the target's layers it runs), "distilled" (`model`: its name is the
    distillation's folder DIR, its quantization the merged draft's) or "eagle" (`model`: its
    name is the head's folder, its quantization the head's). `str(spec)` is the canonical
    text, which `DraftSpec.parse` reads back to an equal spec."""

    kind: DraftKind
    model: ModelSpec | None = None
    ngram: tuple[int, int] | None = None
    depth: int | None = None
    suffix: SuffixOptions | None = None

    def __post_init__(self) -> None:
        # kind -> its fields
        fields = {
            "model": ["model"],
            "ngram": ["ngram"],
            "suffix": ["suffix"],
            "hybrid": ["model", "suffix"],
            "early-exit": ["depth"],
            "distilled": ["model"],
            "eagle": ["model"],
        }
        if self.kind not in fields:
            raise ValueError(f"bad draft kind {self.kind!r}: {DRAFT_FORMS}")
        names = ("model", "ngram", "depth", "suffix")
        given = [name for name in names if getattr(self, name) is not None]
        if given != fields[self.kind]:
            raise ValueError(
                f"a {self.kind} DraftSpec sets {' and '.join(fields[self.kind])} alone "
                f"(got {given})"
            )
        if self.kind in ("model", "hybrid") and _kind(self.model.name) != "model":
            raise _bad_draft(str(self.model), f"a model's name reads as {_kind(self.model.name)}")
        problem = _number_problem(self.ngram, self.depth)
        if problem:
            raise _bad_draft(str(self), problem)

    @property
    def distilled_dir(self) -> str | None:
        """The folder a distilled draft was written to (`distilled:DIR`), else None."""
        return self.model.name if self.kind == "distilled" else None  # type: ignore[union-attr]

    @property
    def eagle_dir(self) -> str | None:
        """The folder of an EAGLE-3 head (`eagle3:DIR`), else None."""
        return self.model.name if self.kind == "eagle" else None  # type: ignore[union-attr]

    @property
    def drafts_trees(self) -> bool:
        """A model, early exit or EAGLE-3 head: what can grow a token tree (n-gram and suffix
        drafts grow their own; a hybrid sizes its own drafts)."""
        return self.kind not in ("ngram", "suffix", "hybrid")

    @property
    def is_model_draft(self) -> bool:
        """A model or early exit: drafts from a model's distribution, which trees and
        --confidence need (n-gram and suffix drafts propose tokens without probabilities; an
        EAGLE-3 head grows trees but has no --confidence yet; a hybrid sizes its own drafts)."""
        return self.kind not in ("ngram", "suffix", "hybrid", "eagle")

    def __str__(self) -> str:
        if self.kind == "suffix":
            return str(self.suffix)
        if self.kind == "hybrid":
            return f"{self.model}+{self.suffix}"
        if self.kind == "ngram":
            return f"ngram:{self.ngram[0]}-{self.ngram[1]}"  # type: ignore[index]
        if self.kind == "early-exit":
            return f"early-exit:{self.depth}"
        if self.kind in _FOLDER_KINDS:
            return f"{_FOLDER_KINDS[self.kind]}{self.model}"
        return str(self.model)

    @classmethod
    def parse(cls, text: str) -> DraftSpec:
        """A `--draft` value -> DraftSpec (ValueError naming the allowed forms if bad)."""
        if text == SUFFIX or text.startswith(SUFFIX + ":"):
            return cls("suffix", suffix=SuffixOptions.parse(text))
        model, plus, options = text.rpartition(HYBRID)
        if plus and (not options or options.startswith(":")):
            if not model:
                raise _bad_draft(text, "a hybrid draft is MODEL+suffix[:OPTIONS]")
            part = cls.parse(model)
            if part.kind != "model":
                raise _bad_draft(text, f"a hybrid drafts with a model, not {part.kind}")
            suffix = SuffixOptions.parse(SUFFIX + options)
            return cls("hybrid", model=part.model, suffix=suffix)
        head, quantization = _split_quantization(text)
        kind = _kind(head)
        if quantization is not None and (kind not in ("model", *_FOLDER_KINDS) or not head):
            raise _bad_draft(
                text,
                f":{quantization} quantizes a draft model; n-gram drafts have no weights and "
                "early-exit shares the target's",
            )
        if kind in _FOLDER_KINDS:
            prefix = _folder_prefix(head, kind)
            folder = head[len(prefix) :]
            if not folder:
                raise _bad_draft(text, f"{prefix} needs its folder, {prefix}DIR")
            problem = _name_problem(folder)
            if problem:
                raise _bad_draft(text, problem)
            return cls(kind, model=ModelSpec(folder, quantization))  # type: ignore[arg-type]
        if kind == "model":
            problem = _name_problem(head)
            if problem:
                raise _bad_draft(text, problem)
            return cls("model", model=ModelSpec(head, quantization))  # type: ignore[arg-type]
        _, sep, rest = text.partition(":")
        if kind == "ngram":
            if not sep:
                return cls("ngram", ngram=DEFAULT_NGRAM)
            low, dash, high = rest.partition("-")
            if not (dash and _NUMBER.fullmatch(low) and _NUMBER.fullmatch(high)):
                raise _bad_draft(text, "an n-gram draft is ngram or ngram:MIN-MAX")
            ngram = (int(low), int(high))
            if problem := _number_problem(ngram, None):  # the error quotes the text as typed
                raise _bad_draft(text, problem)
            return cls("ngram", ngram=ngram)
        if text.partition(":")[0] != "early-exit" or not _NUMBER.fullmatch(rest):
            raise _bad_draft(text, "an early-exit draft needs a depth, early-exit:N")
        if problem := _number_problem(None, int(rest)):
            raise _bad_draft(text, problem)
        return cls("early-exit", depth=int(rest))


def _number_problem(ngram: tuple[int, int] | None, depth: int | None) -> str | None:
    """What is wrong with an n-gram draft's sizes or an early-exit draft's depth, or None."""
    if ngram is not None and not 1 <= ngram[0] <= ngram[1]:
        return "n-gram sizes need 1 <= min <= max"
    if depth is not None and depth < 1:
        return "an early-exit draft needs a depth >= 1"
    return None


def _bad_draft(text: str, why: str) -> ValueError:
    return ValueError(f"bad draft {text!r}: {why}; {DRAFT_FORMS}")


def _kind(head: str) -> DraftKind:
    """The kind a draft text names. Anything starting `early-exit` is meant as one (a missing
    colon is a typo, not a model's name); `ngram`, `distilled` and `eagle` only alone or before a
    colon."""
    if head.startswith("early-exit"):
        return "early-exit"
    for kind, prefix in _FOLDER_KINDS.items():
        if head in (kind, prefix[:-1]) or head.startswith(prefix):
            return kind  # type: ignore[return-value]
    for prefix, kind in _ALIASES.items():
        if head.startswith(prefix):
            return kind  # type: ignore[return-value]
    if head == "ngram" or head.startswith("ngram:"):
        return "ngram"
    return "model"


def _folder_prefix(head: str, kind: str) -> str:
    """The prefix `head` names its folder kind with (the canonical one or an alias)."""
    for prefix, alias in _ALIASES.items():
        if alias == kind and head.startswith(prefix):
            return prefix
    return _FOLDER_KINDS[kind]


def resolve_draft_vocab(size: int | str | None) -> int | None:
    """The draft vocabulary size asked for: None -> $SPECDECODE_DRAFT_VOCAB, else the default;
    0, "all" or "none" -> None (every id). ValueError for anything else but a positive count."""
    if size is None:
        size = os.environ.get(DRAFT_VOCAB_ENV, DEFAULT_DRAFT_VOCAB)
    if isinstance(size, str):
        text = size.strip().lower()
        if text in ("all", "none", "0"):
            return None
        if not text.isascii() or not text.isdigit():
            raise ValueError(
                f"draft vocabulary {size!r}: expected a number of token ids or 'all' "
                f"(from --draft-vocab or ${DRAFT_VOCAB_ENV})"
            )
        size = int(text)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"draft vocabulary {size!r}: expected a number of token ids or 'all'")
    return size or None
