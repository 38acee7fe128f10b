"""Verification of a token tree: which root-to-node path the target keeps, and the next token.

Both functions take the target's rows over the tree (row 0 = root, row i + 1 = node i: the
distribution of the token after that node) and return `(path, next_token)`: `path` lists the
accepted nodes from the root down, `next_token` is the recovered token where the walk stopped, or
the bonus token when it reached a leaf.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import greedy_tokens, sample
from specdecode.core.tree import TokenTree


def verify_tree_greedy(tree: TokenTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Walk down while a child's token equals the target's argmax at its parent.

    target_logits: [N+1, V]. A parent's children hold distinct tokens, so at most one matches
    and the accepted path is unique: the walk finds the longest root-to-node path whose every
    token is the target's argmax at its parent. The argmax at its last row is the next token.
    """
    argmax = greedy_tokens(target_logits).tolist()  # [N+1], one host sync
    tokens = tree.tokens.tolist()
    children = tree.children()
    path: list[int] = []
    row = 0
    while True:
        match = next((c for c in children[row] if tokens[c] == argmax[row]), None)
        if match is None:
            return path, argmax[row]
        path.append(match)
        row = match + 1


def multi_candidate_step(
    p: torch.Tensor,
    candidates: list[int],
    tokens: list[int],
    q_draft: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int | None, int | None]:
    """Recursive rejection sampling over one parent's candidates (SpecInfer's multi-step
    speculative sampling).

    p: [V] target distribution at the parent. candidates: node ids in the order they were drawn
    (repeats allowed); candidate j is token `tokens[c]` drawn from `q_draft[c]` ([V]; one-hot on
    the token when q_draft is None). Returns (accepted node, None) or (None, token sampled from
    the final residual).

    Round j is one ordinary speculative-sampling step with target r_{j-1} (r_0 = p) and proposal
    q_j: accept x_j with probability min(1, r_{j-1}(x_j) / q_j(x_j)), else continue with
    r_j = norm(max(r_{j-1} - q_j, 0)). Lossless when x_j ~ q_j independently of the earlier rounds
    (i.i.d. draws from one q, or fixed tokens with one-hot q): by the single-step lemma, "round j,
    then whatever rounds j+1.. output with law r_j" outputs with law r_{j-1}; the last fallback
    samples r_c exactly, so by induction from the last round the output has law r_0 = p.
    Reordering or de-duplicating the draws by value would break the independence: callers keep
    the draw order and let repeats point at one node.
    """
    r = p
    for node in candidates:
        x = tokens[node]
        if q_draft is None:
            q = torch.zeros_like(p)
            q[x] = 1.0
        else:
            q = q_draft[node]  # [V]
        u = torch.rand((), generator=generator, device=p.device)
        if bool(u * q[x] < r[x]):  # u < r(x)/q(x) without dividing by q
            return node, None
        residual = (r - q).clamp_min(0.0)  # [V]
        total = residual.sum()
        # r <= q everywhere means r == q up to rounding: the rejection had probability ~0 and r
        # itself is still the exact law to continue with
        r = residual / total if float(total) > 0.0 else r
    return None, int(sample(r, generator))


def verify_tree_sampling(
    tree: TokenTree, p_target: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Lossless multi-candidate verification down the tree.

    p_target: [N+1, V] target probabilities after the same processing as the tree's q_draft.
    At each reached row the candidates are tried with `multi_candidate_step`; an accepted child
    becomes the next row, a leaf ends the walk with a bonus token sampled from its row.

    Why the whole walk is lossless: conditional on reaching a row (the accepted path so far) and
    on everything decided before that row's children were drawn — in particular how many draws
    it got, which may depend on any token at its depth or above (dynamic trees) — its draws are
    i.i.d. from its q, so the step emits a token with law p(. | path). The walk continues below
    an accepted child with the same property, so the emitted tokens follow the target's chain
    rule, as if sampled one by one. Trees must therefore never drop a draw after seeing it.
    """
    tokens = tree.tokens.tolist()
    children = tree.children()
    path: list[int] = []
    row = 0
    while children[row]:
        node, recovered = multi_candidate_step(
            p_target[row], children[row], tokens, tree.q_draft, generator
        )
        if node is None:
            assert recovered is not None
            return path, recovered
        path.append(node)
        row = node + 1
    return path, int(sample(p_target[row], generator))  # a leaf: the bonus token
