"""One sequence's state, its prefill, and a chain's share of a step: verify, commit, roll back.

`Batch.step` (batch.py) drafts for every row, runs one target forward over all of them
(`verify_rows`) and settles each row's `Verification`: a chain's here, a tree's in tree_decode.py.
Pure data in, data out: no printing, no clock (docs/architecture.md, Invariants 4). Counters go
into `Stats`; forward times only through the caller's `ForwardMeter` clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.core.cache import Cache, KVCache, NewCache, forward_rows
from specdecode.core.protocols import Drafter
from specdecode.core.sampling import SamplingParams, logits_to_probs
from specdecode.core.types import Draft, ForwardMeter, Stats, StepResult
from specdecode.core.verify import verify_greedy, verify_sampling


@dataclass
class DecodeState:
    """One sequence being generated."""

    tokens: list[int]  # committed ids: prompt + generated
    target_cache: Cache  # covers tokens[:-1] between steps (docs/architecture.md, Invariants 2)


@torch.inference_mode()
def prefill(
    target: Any,
    prompt_ids: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: Stats,
    prefilled: Cache | None = None,
    new_cache: NewCache = KVCache,
) -> tuple[DecodeState, StepResult]:
    """Fill the target's cache with the prompt and commit the first token from the logits after
    its last token: settled like a step that drafted nothing (greedy: the argmax; sampled: from
    the target's distribution with `generator`), so the first token needs no step of its own.

    Returns the state (the prompt and the first token committed, the cache over the prompt) and
    what the prefill committed (not a step: `Stats.steps` does not count it). `prefilled`: a
    cache that already covers a prefix of prompt_ids[:-1] (a prompt prefilled once and reused,
    or a store row that kept a prefix: `LeanStore.open_row`); only the rest is computed, and the
    decode then owns the cache. Else `new_cache(target)` makes the cache (KVCache: the model's
    own forward; the engine passes lean.target_cache). `stats.cached_tokens` counts the prompt
    positions that were not computed.
    """
    if not prompt_ids:
        raise ValueError("the prompt must hold at least one token")
    if prefilled is not None and len(prefilled) > len(prompt_ids) - 1:
        raise ValueError(
            f"a prefilled cache must cover at most the prompt but its last token "
            f"({len(prompt_ids) - 1} positions), not {len(prefilled)}"
        )
    cache = prefilled if prefilled is not None else new_cache(target)
    start = len(cache)
    stats.cached_tokens = start
    device = next(target.parameters()).device
    with stats.meter.forward("prefill", len(prompt_ids) - start):
        logits = cache.forward(torch.tensor(prompt_ids[start:], device=device), last_only=True)
    # the cache covers the whole prompt: the state of a step that verified its last token
    state = DecodeState(tokens=list(prompt_ids), target_cache=cache)
    first = chain_verification(state, None, None, params, generator).settle(logits)  # [1, V]
    return state, first


@dataclass
class Verification:
    """One row's share of a step's target forward: what to feed it and what to do with its
    logits. A chain's and a tree's steps both make one; the step (or a batch of them, batch.py)
    runs the forward and hands each row its logits."""

    inputs: torch.Tensor  # [n] int64: the last committed token, then the drafted tokens
    positions: torch.Tensor | None  # [n] (a tree's); None: the next n positions
    mask: torch.Tensor | None  # [1, 1, n, past + n] (a tree's); None: causal
    # logits [n, V] -> what the step committed (verifies, commits, rolls the cache back)
    settle: Callable[[torch.Tensor], StepResult]


def verify_rows(caches: list[Cache], rows: list[Verification], meter: ForwardMeter) -> list[Any]:
    """One target forward over every row's inputs (`forward_rows`), then each row settled:
    the StepResults in order."""
    with meter.forward("target", sum(int(row.inputs.shape[0]) for row in rows)):
        logits = forward_rows(
            caches,
            [row.inputs for row in rows],
            positions=[row.positions for row in rows],
            masks=[row.mask for row in rows],
        )
    return [row.settle(row_logits) for row, row_logits in zip(rows, logits, strict=True)]


def chain_verification(
    state: DecodeState,
    drafter: Drafter | None,
    draft: Draft | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verification:
    """The verification of a chain `draft` (None or empty: one autoregressive step)."""
    cache = state.target_cache
    device = next(cache.model.parameters()).device
    drafted = draft.tokens if draft is not None else torch.empty(0, dtype=torch.long)
    drafted = drafted.to(device)  # [k'], k' <= k
    # the last committed token and the drafts
    inputs = torch.cat([torch.tensor(state.tokens[-1:], device=device), drafted])  # [k'+1]

    def settle(logits: torch.Tensor) -> StepResult:  # logits [k'+1, V]
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
        return StepResult(
            committed,
            depth=len(drafted),
            nodes=len(drafted),
            accepted=n_accepted,
            logits=logits,
        )

    return Verification(inputs, None, None, settle)
