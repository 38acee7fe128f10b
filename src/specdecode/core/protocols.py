"""The drafter protocol: whatever proposes tokens for the target to verify.

The core codes against these protocols only; the implementations live in drafters/ and the core
never imports them (docs/architecture.md, Invariants 5). The tree drafter's protocol sits with the
token tree it proposes (tree.py).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from specdecode.core.sampling import SamplingParams
from specdecode.core.types import Draft, ForwardMeter


class BaseDrafter(Protocol):
    """What every drafter, chain or tree, does: a name and a start per sequence."""

    name: str

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: object,
        meter: ForwardMeter,
    ) -> None:
        """Start a new sequence whose committed tokens are `prompt_ids` (the prompt and the
        prefill's first token; reset state; may prefill over prompt_ids[:-1])."""


@runtime_checkable
class Drafter(BaseDrafter, Protocol):
    """A drafter proposing one chain of tokens."""

    def propose(self, context: list[int], k: int) -> Draft:
        """Draft k tokens following the committed tokens `context`."""

    def observe(self, n_accepted: int) -> None:
        """Learn how many of the last proposal's tokens the target kept (and roll back)."""
