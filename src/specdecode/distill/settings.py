"""What one `specdecode distill` run is asked to do (`DistillSettings`), checked before any
model is loaded, and its budget (`Budget`: a training time or a number of trained tokens)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from specdecode.core.draft_spec import DraftSpec, ModelSpec

LOSSES = ("kl", "tv")  # forward KL(p_target || q_draft) or total variation, on the top-k + tail
AUTOCAST = ("auto", "bf16", "off")
KINDS = ("lora", "eagle")  # LoRA adapters on the draft, or an EAGLE-3 head (distill/eagle.py)
_TIME_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_TOKEN_UNITS = {"": 1, "k": 1_000, "K": 1_000, "M": 1_000_000}
_BUDGET = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|k|K|M)?")
BUDGET_FORMS = (
    "a budget is a training time (90s, 30m, 1.5h) or a number of trained tokens (5000, 200k, 2M)"
)


@dataclass(frozen=True)
class Budget:
    """How long training may run: `seconds` of training (summed over resumed runs) or `tokens`
    (answer positions trained on, every pass counted); exactly one is set."""

    text: str
    seconds: float | None = None
    tokens: int | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        """`30m`, `90s`, `1.5h` (time; `ms` too, for tests) or `200k`, `2M`, `5000` (tokens);
        ValueError otherwise."""
        match = _BUDGET.fullmatch(text.strip())
        if not match:
            raise ValueError(f"bad --budget {text!r}: {BUDGET_FORMS}")
        number, unit = float(match.group(1)), match.group(2) or ""
        if number <= 0:
            raise ValueError(f"bad --budget {text!r}: it must be above zero; {BUDGET_FORMS}")
        if unit == "ms":
            return cls(text, seconds=number / 1000)
        if unit in _TIME_UNITS:  # m: minutes; M: a million tokens
            return cls(text, seconds=number * _TIME_UNITS[unit])
        tokens = number * _TOKEN_UNITS[unit]
        if tokens != math.floor(tokens):
            raise ValueError(f"bad --budget {text!r}: a whole number of tokens; {BUDGET_FORMS}")
        return cls(text, tokens=int(tokens))

    def describe(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds:g} s of training"
        return f"{self.tokens} trained tokens"


def parse_temperatures(text: str) -> list[float]:
    """ "0,0.7" -> [0.0, 0.7] (0 = the greedy answer), each once, in the order given."""
    values: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"bad --temperatures {text!r}: expected numbers like 0,0.7") from None
        if not 0 <= value <= 5 or math.isnan(value):
            raise ValueError(f"bad --temperatures {text!r}: each is 0 (greedy) to 5")
        if value not in values:
            values.append(value)
    if not values:
        raise ValueError(f"bad --temperatures {text!r}: give at least one (0 = greedy)")
    return values


@dataclass
class DistillSettings:
    target: str
    draft: str
    out: str
    prompts: str | None = None  # a JSONL suite (bench format); None: the built-in suite
    categories: list[str] | None = None
    self_prompts: int | None = None  # prompts per category the target writes itself
    holdout: float = 0.25  # share of each category's prompts never trained on (by id)
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    samples: int = 1  # answers per prompt at each temperature above 0
    max_new_tokens: int = 128
    top_k: int = 32  # the target's most probable tokens kept per position
    chat: bool = True
    rows: int = 8  # answers made at once (batched decoding of the target); 1: speculative
    budget: Budget = field(default_factory=lambda: Budget.parse("30m"))
    loss: str = "kl"
    lora_rank: int = 16
    lora_alpha: float | None = None  # None: twice the rank
    lr: float = 2e-4
    batch_size: int = 4  # answers per optimizer step
    checkpoint_every: int = 50  # steps
    seed: int = 0
    dtype: str = "bfloat16"  # the target's (and the generating draft's) weights for the data
    device: str | None = None
    autocast: str = "auto"  # training: bf16 autocast over float32 master weights, or off
    kind: str = "lora"  # what is trained: LoRA adapters on the draft, or an EAGLE-style head

    def validate(self) -> None:
        """ValueError for anything wrong that needs no model (before any is loaded)."""
        ModelSpec.parse(self.target, "target")
        spec = DraftSpec.parse(self.draft)
        if spec.kind != "model":
            raise ValueError(
                f"--draft {self.draft!r}: distill trains a draft model (a preset, folder or hub "
                "id); n-gram and early-exit drafts have no weights of their own to train, and a "
                "distilled draft is distilled again from its base draft"
            )
        if self.self_prompts is not None and self.self_prompts < 1:
            raise ValueError(f"--self-prompts must be >= 1 (got {self.self_prompts})")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"--holdout is a share from 0 to below 1 (got {self.holdout})")
        for name in ("samples", "max_new_tokens", "top_k", "rows", "lora_rank", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})"
                )
        if self.checkpoint_every < 1:
            raise ValueError(f"--checkpoint-every must be >= 1 (got {self.checkpoint_every})")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss is one of {', '.join(LOSSES)} (got {self.loss!r})")
        if self.kind not in KINDS:
            raise ValueError(f"--kind is one of {', '.join(KINDS)} (got {self.kind!r})")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"--autocast is one of {', '.join(AUTOCAST)} (got {self.autocast!r})")
        if not self.lr > 0:
            raise ValueError(f"--lr must be above zero (got {self.lr})")

    @property
    def alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    def data_key(self) -> dict[str, Any]:
        """What makes cached answers reusable: the same target, per-position top-k, answer
        length and chat formatting (prompts, temperatures and samples are per answer)."""
        return {
            "target": self.target,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "chat": self.chat,
        }

    def train_key(self) -> dict[str, Any]:
        """What makes a checkpoint resumable: everything training depends on but the budget
        (a larger budget continues a finished run)."""
        keys = ("loss", "lora_rank", "lr", "batch_size", "seed", "autocast")
        base = ModelSpec.parse(self.draft, "draft").name  # trained on its own weights
        key = {**{k: getattr(self, k) for k in keys}, "draft": base, "alpha": self.alpha}
        if self.kind != "lora":  # (a LoRA run's key stays what it was: its checkpoints resume)
            key["kind"] = self.kind
        return key

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["budget"] = self.budget.text
        return data
