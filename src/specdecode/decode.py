"""The decoding core: prefill, one speculative step, and the generation loop.

Pure data in, data out: no printing, no clock (invariant 4). Counters go into `Stats`; forward
times only through the caller's `ForwardMeter` clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.cache import KVCache
from specdecode.drafters.base import Drafter
from specdecode.policies import FixedK, KPolicy, forward_seconds, seconds_since
from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.tree import TreeDrafter
from specdecode.types import Stats, StepResult
from specdecode.verify import verify_greedy, verify_sampling


@dataclass
class DecodeState:
    """One sequence being generated."""

    tokens: list[int]  # committed ids: prompt + generated
    target_cache: KVCache  # covers tokens[:-1] between steps (invariant 2)


@torch.inference_mode()
def prefill(
    target: Any, prompt_ids: list[int], stats: Stats, prefilled: KVCache | None = None
) -> DecodeState:
    """Fill the target's cache with all prompt tokens but the last (the first step's input).

    `prefilled`: a cache that already covers prompt_ids[:-1] (a prompt prefilled once and
    reused); it is used as is, and the decode then owns it.
    """
    if prefilled is not None:
        if len(prefilled) != len(prompt_ids) - 1:
            raise ValueError(
                f"a prefilled cache must cover the prompt but its last token "
                f"({len(prompt_ids) - 1} positions), not {len(prefilled)}"
            )
        return DecodeState(tokens=list(prompt_ids), target_cache=prefilled)
    cache = KVCache(target)
    if len(prompt_ids) > 1:
        device = next(target.parameters()).device
        with stats.meter.forward("prefill", len(prompt_ids) - 1):
            cache.forward(torch.tensor(prompt_ids[:-1], device=device), last_only=True)
    return DecodeState(tokens=list(prompt_ids), target_cache=cache)


@torch.inference_mode()
def speculative_step(
    state: DecodeState,
    drafter: Drafter | None,
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: Stats,
) -> StepResult:
    """Draft up to k tokens, verify them in one target forward, commit, roll back.

    k == 0, no drafter, or an empty draft is one plain autoregressive step.
    """
    cache = state.target_cache
    device = next(cache.model.parameters()).device
    draft = drafter.propose(state.tokens, k) if drafter is not None and k > 0 else None
    drafted = draft.tokens if draft is not None else torch.empty(0, dtype=torch.long)
    drafted = drafted.to(device)  # [k'], k' <= k

    # one target forward over the last committed token and the drafts
    inputs = torch.cat([torch.tensor(state.tokens[-1:], device=device), drafted])  # [k'+1]
    with stats.meter.forward("target", inputs.shape[0]):
        logits = cache.forward(inputs)  # [k'+1, V]

    if params.greedy:
        n_accepted, next_token = verify_greedy(drafted, logits)
    else:
        p_target = logits_to_probs(logits, params)  # [k'+1, V]
        q_draft = draft.q_draft if draft is not None else None
        if q_draft is not None and q_draft.shape[-1] < p_target.shape[-1]:
            # the drafter samples from the common vocabulary: zero mass beyond it
            q_draft = F.pad(q_draft, (0, p_target.shape[-1] - q_draft.shape[-1]))
        n_accepted, next_token = verify_sampling(drafted, q_draft, p_target, generator)

    committed = [*drafted[:n_accepted].tolist(), next_token]
    state.tokens.extend(committed)
    cache.rollback(len(state.tokens) - 1)  # keep committed tokens minus the last
    if draft is not None:
        drafter.observe(n_accepted)  # type: ignore[union-attr]
    return StepResult(committed, len(drafted), n_accepted)


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
    prefilled: KVCache | None = None,
) -> Iterator[list[int]]:
    """Generate up to `max_new_tokens` tokens after `prompt_ids`, yielding each step's tokens.

    With `drafter=None` this is the autoregressive baseline (one target forward per token).
    Each step drafts `k_policy.next_k(...)` tokens (default: `FixedK(k)`); the policy then
    observes the step's counts and forward-time deltas (read from the meter, never a clock).
    Stops exactly (invariant 3): never more than max_new_tokens, and the first EOS id inside a
    committed block ends the output (the EOS token itself is the last token yielded).
    """
    params = params or SamplingParams()
    stats = stats if stats is not None else Stats()
    policy = k_policy if k_policy is not None else FixedK(k)
    stats.k = policy.k_max if drafter is not None else 0
    stats.k_policy = policy.name if drafter is not None else ""
    stats.prompt_tokens = len(prompt_ids)
    state = prefill(target, prompt_ids, stats, prefilled)
    if drafter is not None:
        with torch.inference_mode():  # the draft's prefill: no autograd graph, no slow fallbacks
            drafter.begin(prompt_ids, params, generator, stats.meter)
        policy.begin()

    tree = isinstance(drafter, TreeDrafter)  # a token tree per step (tree_decode.py)
    if tree:
        from specdecode.tree_decode import tree_step  # it builds on this module

    produced = 0
    while produced < max_new_tokens:
        # a step emits up to k_step + 1 tokens: never draft past max_new_tokens
        allowed = max_new_tokens - produced - 1
        k_step = max(0, min(policy.next_k(allowed), allowed)) if drafter is not None else 0
        spent = forward_seconds(stats.meter)
        if tree:  # the tree's depth, not k, is bounded by what is left to emit
            step = tree_step(state, drafter, params, generator, stats, max_depth=allowed)
        else:
            step = speculative_step(state, drafter, k_step, params, generator, stats)
        if drafter is not None:
            policy.observe(step.drafted, step.accepted, *seconds_since(stats.meter, spent))
        stats.k_hist[k_step] = stats.k_hist.get(k_step, 0) + 1
        committed, n_accepted = step.committed, step.accepted
        eos_at = next((i for i, t in enumerate(committed) if t in eos_token_ids), None)
        if eos_at is not None:
            committed = committed[: eos_at + 1]
            n_accepted = min(n_accepted, eos_at + 1)  # an accepted EOS counts
        stats.record_step(step.drafted, n_accepted, len(committed))
        produced += len(committed)
        stats.new_tokens = produced
        yield committed
        if eos_at is not None:
            stats.stop_reason = "eos"
            return
    stats.stop_reason = "length"
