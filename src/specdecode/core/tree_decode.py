"""A token tree's share of a step: every node verified in the target forward that `Batch.step`
runs for all rows, the accepted path committed, the cache compacted to it.

The tree counterpart of `step.chain_verification`, with the same state and the same StepResult;
`depth` is the tree's depth (the most tokens the step could accept), `nodes` its node count, which
`Stats.nodes_verified` sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.core.sampling import SamplingParams, logits_to_probs
from specdecode.core.step import DecodeState, Verification
from specdecode.core.tree import TokenTree, TreeDrafter, verification_inputs
from specdecode.core.types import Stats, StepResult
from specdecode.core.verify_tree import verify_tree_greedy, verify_tree_sampling


def tree_verification(
    state: DecodeState,
    drafter: TreeDrafter,
    tree: TokenTree,
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: Stats,
) -> Verification:
    """The verification of a token tree: the root (last committed token) and every node in
    one forward, each row seeing the prefix and its ancestors only; settling commits the
    accepted path and compacts the cache to it."""
    cache = state.target_cache
    model = cache.model
    device = next(model.parameters()).device
    tree.tokens = tree.tokens.to(device)
    past = len(cache)  # == len(state.tokens) - 1 (docs/architecture.md, Invariants 2)
    dtype = next(model.parameters()).dtype
    inputs, positions, mask = verification_inputs(tree, state.tokens[-1], past, dtype)

    def settle(logits: torch.Tensor) -> StepResult:  # logits [N+1, V]
        if params.greedy:
            path, next_token = verify_tree_greedy(tree, logits)
        else:
            p_target = logits_to_probs(logits, params)  # [N+1, V]
            if tree.q_draft is not None:
                q_draft = tree.q_draft.to(p_target.device)  # [N, V_common]
                # the drafter samples from the common vocabulary: zero mass beyond it
                tree.q_draft = F.pad(q_draft, (0, p_target.shape[-1] - q_draft.shape[-1]))
            path, next_token = verify_tree_sampling(tree, p_target, generator)
        committed = [*tree.tokens[path].tolist(), next_token]
        state.tokens.extend(committed)
        # keep the prefix, the root and the accepted nodes (row i + 1 sits at past + 1 + i)
        path_rows = torch.tensor(path, dtype=torch.long) + past + 1
        cache.compact(torch.cat([torch.arange(past + 1), path_rows]))
        drafter.observe_path(path)
        result = StepResult(
            committed,
            depth=tree.max_depth,
            nodes=len(tree),
            accepted=len(path),
            logits=logits,
            logit_rows=[0, *(node + 1 for node in path)],  # node i's logits are row i + 1
        )
        stats.nodes_verified += result.nodes  # a chain's nodes are its depth: trees only
        return result

    return Verification(inputs, positions, mask, settle)
