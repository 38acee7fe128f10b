"""The generation loop: prefill, then one step after another until the length or an EOS.

The step itself (draft, verify, commit, roll back) is step.py's chain step or tree_decode.py's
tree step, chosen once per generation from the drafter's kind. Pure data in, data out: no
printing, no clock (docs/architecture.md, Invariants 4). Counters go into `Stats`; forward times
only through the caller's `ForwardMeter` clock.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from specdecode.cache import Cache, KVCache, NewCache
from specdecode.drafter import Drafter
from specdecode.policies import FixedK, KPolicy, forward_seconds, seconds_since
from specdecode.sampling import SamplingParams
from specdecode.step import DecodeState, prefill, speculative_step
from specdecode.tree import TreeDrafter
from specdecode.tree_decode import tree_step
from specdecode.types import Stats, StepResult

# one step: (state, k asked for, the most tokens the step may draft) -> what it committed
Step = Callable[[DecodeState, int, int], StepResult]


def step_function(
    drafter: Drafter | TreeDrafter | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: Stats,
) -> Step:
    """The step the loop runs: a token tree for a `TreeDrafter`, else a chain of up to k."""
    if isinstance(drafter, TreeDrafter):
        # the tree's depth, not k, is bounded by what is left to emit
        return lambda state, k, allowed: tree_step(
            state, drafter, params, generator, stats, max_depth=allowed
        )
    return lambda state, k, allowed: speculative_step(state, drafter, k, params, generator, stats)


def decode(
    target: Any,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    drafter: Drafter | TreeDrafter | None = None,
    k: int = 4,
    k_policy: KPolicy | None = None,
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    eos_token_ids: Collection[int] = (),
    stats: Stats | None = None,
    prefilled: Cache | None = None,
    new_cache: NewCache = KVCache,
) -> Iterator[list[int]]:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`, yielding each step's tokens.

    With `drafter=None` this is the autoregressive baseline (one target forward per token).
    Each step drafts `k_policy.next_k(...)` tokens (default: `FixedK(k)`); the policy then
    observes the step's counts and forward-time deltas (read from the meter, never a clock).
    Stops exactly (docs/architecture.md, Invariants 3): never more than max_new_tokens, and the
    first EOS id inside a committed block ends the output (the EOS token is the last yielded).
    The target runs through `new_cache(target)` (or `prefilled`, a cache over the prompt but its
    last token): KVCache is the model's own forward.
    """
    params = params or SamplingParams()
    stats = stats if stats is not None else Stats()
    policy = k_policy if k_policy is not None else FixedK(k)
    stats.k_max = policy.k_max if drafter is not None else 0
    stats.k_policy = policy.name if drafter is not None else ""
    stats.prompt_tokens = len(prompt_ids)
    state = prefill(target, prompt_ids, stats, prefilled, new_cache)
    if drafter is not None:
        with torch.inference_mode():  # the draft's prefill: no autograd graph, no slow fallbacks
            drafter.begin(prompt_ids, params, generator, stats.meter)
        policy.begin()
    take_step = step_function(drafter, params, generator, stats)

    produced = 0
    while produced < max_new_tokens:
        # a step emits up to k_step + 1 tokens: never draft past max_new_tokens
        allowed = max_new_tokens - produced - 1
        k_step = max(0, min(policy.next_k(allowed), allowed)) if drafter is not None else 0
        spent = forward_seconds(stats.meter)
        step = take_step(state, k_step, allowed)
        if drafter is not None:
            policy.observe(step.depth, step.accepted, *seconds_since(stats.meter, spent))
        stats.k_hist[k_step] = stats.k_hist.get(k_step, 0) + 1
        committed, n_accepted = step.committed, step.accepted
        eos_at = next((i for i, t in enumerate(committed) if t in eos_token_ids), None)
        if eos_at is not None:
            committed = committed[: eos_at + 1]
            n_accepted = min(n_accepted, eos_at + 1)  # an accepted EOS counts
        stats.record_step(step.depth, n_accepted, len(committed))
        produced += len(committed)
        stats.new_tokens = produced
        yield committed
        if eos_at is not None:
            stats.stop_reason = "eos"
            return
    stats.stop_reason = "length"
