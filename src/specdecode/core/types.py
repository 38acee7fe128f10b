"""The data the decoding core passes around and returns.

Vocabulary: docs/architecture.md, Vocabulary; metrics.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from specdecode.core import metrics


@dataclass
class Draft:
    """What a drafter proposes for one step."""

    tokens: torch.Tensor  # [k] int64: the drafted token ids
    # [k, V] float32: the distribution each token was actually sampled from, after the same
    # temperature/top-k/top-p processing as the target; None = deterministic (one-hot) proposal.
    q_draft: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class StepResult:
    """What one speculative step committed."""

    committed: list[int]  # accepted drafts + the recovered or bonus token
    # positions offered for acceptance along one path: k' for a chain (may be fewer than k, e.g.
    # no n-gram match), the tree's depth for a tree
    depth: int
    nodes: int  # tokens the target verified besides the root: k' for a chain, a tree's node count
    accepted: int
    # the step's target logits [nodes + 1, V] (raw: before temperature / top-k / top-p), kept
    # by reference for whoever wants them (`Batch.add(on_logits=...)`: distillation's data),
    # and the rows of the committed path in them (None: the first ones, a chain's)
    logits: torch.Tensor | None = None
    logit_rows: list[int] | None = None

    def committed_logits(self) -> torch.Tensor | None:
        """[len(committed), V]: the target's logits before each committed token."""
        if self.logits is None:
            return None
        if self.logit_rows is None:
            return self.logits[: len(self.committed)]
        return self.logits[self.logit_rows]


class ForwardMeter:
    """Counts model forwards and, when the caller gives a clock, times them.

    The core never reads a clock: the caller injects `clock` (e.g. a `time.perf_counter` that
    synchronises CUDA first). `kind` is "target" or "draft" (or a drafter's own label).
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock
        self.calls: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    @contextmanager
    def forward(self, kind: str, n_tokens: int) -> Iterator[None]:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.tokens[kind] = self.tokens.get(kind, 0) + n_tokens
        if self.clock is None:
            yield
            return
        start = self.clock()
        yield
        self.seconds[kind] = self.seconds.get(kind, 0.0) + self.clock() - start

    def seconds_for(self, kind: str, n_tokens: int) -> float | None:
        """`n_tokens` of `kind` at the rate of those timed so far (None before any)."""
        done, seconds = self.tokens.get(kind, 0), self.seconds.get(kind, 0.0)
        return seconds / done * n_tokens if done and seconds else None

    def add(self, kind: str, n_tokens: int, seconds: float | None) -> None:
        """Count a forward timed elsewhere (a row's share of a batch's forward)."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.tokens[kind] = self.tokens.get(kind, 0) + n_tokens
        if seconds is not None and self.clock is not None:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds


@dataclass
class Stats:
    """Raw counters of one generation, filled by the core; rates are derived (metrics.py)."""

    k_max: int = 0  # the most tokens any step may draft (0 = autoregressive); a policy's k_max
    k_policy: str = ""  # the policy choosing each step's k ("fixed", "heuristic", "cost")
    k_hist: dict[int, int] = field(default_factory=dict)  # steps per k asked for
    steps: int = 0  # target forwards after prefill (verification steps; not the first token's)
    drafted: int = 0  # positions offered for acceptance: the steps' depths summed
    accepted: int = 0
    emitted: int = 0  # tokens committed by steps (accepted + recovered/bonus, after stops)
    new_tokens: int = 0  # tokens returned to the caller: the prefill's first token + emitted
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt positions the target's cache already held (not prefilled)
    drafted_at: list[int] = field(default_factory=list)  # [k] drafts at position i
    accepted_at: list[int] = field(default_factory=list)  # [k] acceptances at position i
    nodes_verified: int = 0  # token-tree nodes the target verified: the steps' nodes (trees only)
    stop_reason: str = ""  # "length", "eos" or "stop"
    # measured by the caller around the core (engine), never inside it
    wall_time_s: float = 0.0  # from the call to the last token
    ttft_s: float = 0.0  # time to first token (the target's prefill, which gives it)
    meter: ForwardMeter = field(default_factory=ForwardMeter, repr=False)

    def record_step(self, n_drafted: int, n_accepted: int, n_emitted: int) -> None:
        self.steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.emitted += n_emitted
        if len(self.drafted_at) < n_drafted:
            grow = n_drafted - len(self.drafted_at)
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return metrics.acceptance_rate(self.accepted, self.drafted)

    @property
    def mean_acceptance_length(self) -> float | None:
        return metrics.mean_acceptance_length(self.emitted, self.steps)

    @property
    def per_position_acceptance(self) -> list[float | None]:
        return metrics.per_position_acceptance(self.accepted_at, self.drafted_at)

    @property
    def prefill_s(self) -> float:
        """Time in prompt prefill forwards (target and drafter), when a clock was given."""
        return self.meter.seconds.get("prefill", 0.0) + self.meter.seconds.get("draft_prefill", 0.0)

    @property
    def tokens_per_s(self) -> float | None:
        return metrics.ratio(self.new_tokens, self.wall_time_s)

    @property
    def target_forwards(self) -> int:
        return self.meter.calls.get("target", 0)

    @property
    def draft_forwards(self) -> int:
        return self.meter.calls.get("draft", 0)

    def to_dict(self) -> dict[str, Any]:
        """Every counter and rate by name, JSON-ready (what `--json` prints and the bench keeps);
        a rate that has no data yet (nothing drafted, no clock) is None."""
        return {
            "k_max": self.k_max,
            "k_policy": self.k_policy,
            "k_hist": dict(sorted(self.k_hist.items())),
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "new_tokens": self.new_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "wall_time_s": self.wall_time_s,
            "prefill_s": self.prefill_s,
            "ttft_s": self.ttft_s,
            "tokens_per_s": self.tokens_per_s,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "nodes_verified": self.nodes_verified,
            "forward_s": dict(self.meter.seconds),
            "stop_reason": self.stop_reason,
        }

    def __getitem__(self, key: str) -> Any:
        """`stats["tokens_per_s"]`: the counter or rate of that name, as `to_dict()` gives it."""
        values = self.to_dict()
        if key not in values:
            raise KeyError(f"Stats has no {key!r}; it has {', '.join(values)}")
        return values[key]


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # decoded new text, None when the model has no tokenizer
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": self.token_ids, "text": self.text, "stats": self.stats.to_dict()}
