"""One token-tree step: draft a tree, verify every node in one target forward, compact the cache.

The tree counterpart of `step.speculative_step`, with the same state and the same StepResult;
`depth` is the tree's depth (the most tokens the step could accept), `nodes` its node count, which
`Stats.nodes_verified` sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.sampling import SamplingParams, logits_to_probs
from specdecode.step import DecodeState, speculative_step
from specdecode.tree import TreeDrafter, verification_inputs
from specdecode.types import Stats, StepResult
from specdecode.verify_tree import verify_tree_greedy, verify_tree_sampling


@torch.inference_mode()
def tree_step(
    state: DecodeState,
    drafter: TreeDrafter,
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: Stats,
    max_depth: int | None = None,
) -> StepResult:
    """Draft a tree of at most `max_depth` levels, verify it in one forward, commit the path.

    max_depth 0 (one token left to emit) is a plain autoregressive step.
    """
    if max_depth is not None and max_depth < 1:
        return speculative_step(state, None, 0, params, generator, stats)
    cache = state.target_cache
    model = cache.model
    device = next(model.parameters()).device
    tree = drafter.propose_tree(state.tokens, max_depth if max_depth is not None else 1 << 30)
    tree.tokens = tree.tokens.to(device)

    # one target forward over the root (last committed token) and every node, each row seeing
    # the prefix and its ancestors only
    past = len(cache)  # == len(state.tokens) - 1 (docs/architecture.md, Invariants 2)
    dtype = next(model.parameters()).dtype
    inputs, positions, mask = verification_inputs(tree, state.tokens[-1], past, dtype)
    with stats.meter.forward("target", inputs.shape[0]):
        logits = cache.forward(inputs, position_ids=positions, attention_mask=mask)  # [N+1, V]

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
    result = StepResult(committed, depth=tree.max_depth, nodes=len(tree), accepted=len(path))
    stats.nodes_verified += result.nodes  # a chain's nodes are its depth: counted for trees only
    return result
