"""The generation loop of one sequence: a batch of one, stepped until the length or an EOS.

The step itself (draft, verify, commit, roll back) is batch.py's, for a chain or a token tree
(chosen per row from the drafter's kind); there is no second decoding loop. Pure data in, data
out: no printing, no clock (docs/architecture.md, Invariants 4). Counters go into `Stats`;
forward times only through the caller's `ForwardMeter` clock.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from typing import Any

import torch

from specdecode.core.batch import Batch
from specdecode.core.cache import Cache, KVCache, NewCache
from specdecode.core.policies import FixedK, KPolicy
from specdecode.core.protocols import Drafter
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import TreeDrafter
from specdecode.core.types import Stats


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
    """Generate up to `max_new_tokens` tokens after `prompt_ids`, yielding the prefill's first
    token, then each step's tokens.

    With `drafter=None` this is the autoregressive baseline (one target forward per token).
    Each step drafts `k_policy.next_k(...)` tokens (default: `FixedK(k)`); the policy then
    observes the step's counts and forward-time deltas (read from the meter, never a clock).
    Stops exactly (docs/architecture.md, Invariants 3): never more than max_new_tokens, and the
    first EOS id inside a committed block ends the output (the EOS token is the last yielded).
    The target runs through `new_cache(target)` (or `prefilled`, a cache over the prompt but its
    last token): KVCache is the model's own forward.
    """
    stats = stats if stats is not None else Stats()
    policy = k_policy if k_policy is not None else FixedK(k)
    batch = Batch(target, policy=policy, meter=stats.meter, new_cache=new_cache)
    row = batch.add(
        prompt_ids,
        max_new_tokens,
        drafter=drafter,
        params=params,
        generator=generator,
        eos_token_ids=eos_token_ids,
        stats=stats,
        prefilled=prefilled,
    )
    try:
        if row.committed:  # the first token, from the prefill
            yield row.committed
        while not row.done:
            batch.step()
            if row.error is not None:
                raise row.error
            yield row.committed
    finally:  # finished, failed or closed early: the drafter ends its sequence (`end`)
        if row.drafting:
            row.drafting = False
            row.drafter.end()  # type: ignore[union-attr]
