"""The drafter protocols: whatever proposes tokens for the target to verify.

The core codes against these protocols only; the implementations live in drafters/ and the core
never imports them (docs/architecture.md, Invariants 5). The tree drafter's protocol sits with the
token tree it proposes (tree.py). A drafter subclasses its protocol: the optional hooks
(`follow`, `share_costs`, `prefill_positions`, `defer_prefill`, `end`, `propose_many`, `cost_ratio`) are declared here with defaults that do nothing
special, so the core calls them on every drafter and never asks whether one has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from specdecode.core.cache import Cache
from specdecode.core.sampling import SamplingParams
from specdecode.core.types import Draft, ForwardMeter


class BaseDrafter(Protocol):
    """What every drafter, chain or tree, does: a name and a start per sequence."""

    name: str
    # c, a draft forward's time over a one-token target forward's, where the drafter knows it
    # (prompt lookup: 0, no model); None: policies.prior_cost_ratio guesses it from sizes
    cost_ratio: float | None = None

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: object,
        meter: ForwardMeter,
    ) -> None:
        """Start a new sequence whose committed tokens are `prompt_ids` (the prompt and the
        prefill's first token; reset state; may prefill over prompt_ids[:-1])."""

    def follow(self, target_cache: Cache) -> None:
        """Before `begin`: the target cache of the sequence, for a drafter that reads the
        target's features (drafters/eagle.py). Default: nothing."""

    def share_costs(self, policy: object) -> None:
        """Before `begin`: the batch's k policy, whose measured costs a drafter that sizes its
        own draft reads (`policies.verify_cost`: a suffix tree, a hybrid's choice). Default:
        nothing."""

    def prefill_positions(self, prompt_ids: list[int]) -> int:
        """How many positions `begin(prompt_ids, ...)` would compute in its draft's prefill, by
        which the core prices it (`Batch._pays`): a draft model holding a prefix of the prompt
        already computes only the rest. Default: all of prompt_ids[:-1]."""
        return max(0, len(prompt_ids) - 1)

    def defer_prefill(self) -> None:
        """Before `begin`, from a batch that begins the drafter at its row's first drafting
        step rather than with the row's prefill (`Batch.add(begin_draft=False)`: a server's
        rows): a drafter that can draft before its own prefill (the hybrid, with its suffix)
        may leave that prefill to the first step where it pays. Default: nothing."""

    def end(self) -> None:
        """The sequence is over (finished, cancelled or failed): give back what `begin` took
        (a model draft's cache to its prefix pool). Default: nothing."""


@runtime_checkable
class Drafter(BaseDrafter, Protocol):
    """A drafter proposing one chain of tokens."""

    def propose(self, context: list[int], k: int) -> Draft:
        """Draft k tokens following the committed tokens `context`."""

    def observe(self, n_accepted: int) -> None:
        """Learn how many of the last proposal's tokens the target kept (and roll back)."""

    @classmethod
    def propose_many(
        cls, drafters: Sequence[Drafter], contexts: Sequence[list[int]], ks: Sequence[int]
    ) -> list[Draft]:
        """The chains of several drafters of this class, one per context; a class that can
        draft them together (model drafters: one forward per depth for all) overrides it.
        Default: one by one."""
        return [d.propose(ctx, k) for d, ctx, k in zip(drafters, contexts, ks, strict=True)]


# (class, protocol) -> whether the class's instances implement it
_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def implements(drafter: object, protocol: type) -> bool:
    """`isinstance(drafter, protocol)` for a runtime-checkable protocol, computed once per class
    (a drafter's members are its class's): the check walks the protocol's members on every call,
    tens of microseconds each, and a batch's step asks it for every row."""
    key = (type(drafter), protocol)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = isinstance(drafter, protocol)
    return known
