"""Verification: pure tensor maths deciding how much of a draft the target keeps.

Both functions return `(n_accepted, next_token)`: the first `n_accepted` drafted tokens are kept,
then `next_token` is appended — the recovered token at the first rejection, or the bonus token
when all `k` drafts were accepted.
"""

from __future__ import annotations

import torch

from specdecode.core.sampling import greedy_tokens, sample


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Keep drafts while each equals the target's argmax.

    draft_tokens: [k] int64; target_logits: [k+1, V] (row i predicts the token after draft i).
    """
    k = draft_tokens.shape[0]
    target_tokens = greedy_tokens(target_logits)  # [k+1]
    matches = draft_tokens == target_tokens[:k]  # [k]
    n_accepted = int(matches.cumprod(0).sum())  # length of the all-true prefix
    return n_accepted, int(target_tokens[n_accepted])


def verify_sampling(
    draft_tokens: torch.Tensor,
    q_draft: torch.Tensor | None,
    p_target: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Lossless rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    draft_tokens: [k] int64, drafted token x_i was sampled from q_draft[i].
    q_draft: [k, V] probabilities, or None for a deterministic proposal (q one-hot on x_i).
    p_target: [k+1, V] target probabilities after the same processing as q_draft.

    x_i is accepted with probability min(1, p(x_i) / q(x_i)); at the first rejection the next token
    is sampled from norm(max(0, p - q)); if all k are accepted, a bonus token is sampled from p[k].
    The output is then distributed exactly as tokens sampled from p_target one by one.
    """
    k = draft_tokens.shape[0]
    positions = torch.arange(k, device=p_target.device)
    p_x = p_target[positions, draft_tokens]  # [k]
    q_x = q_draft[positions, draft_tokens] if q_draft is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=p_target.device)  # [k]
    accepted = u * q_x < p_x  # u < p/q without dividing by q
    n_accepted = int(accepted.cumprod(0).sum())
    if n_accepted == k:
        return k, int(sample(p_target[k], generator))

    p = p_target[n_accepted]  # [V]
    if q_draft is not None:
        q = q_draft[n_accepted]
    else:
        q = torch.zeros_like(p)
        q[draft_tokens[n_accepted]] = 1.0
    residual = (p - q).clamp_min(0.0)  # [V]
    total = residual.sum()
    if float(total) <= 0.0:
        # p == q up to rounding: a rejection had (numerically) zero probability; p is exact then
        residual, total = p, p.sum()
    return n_accepted, int(sample(residual / total, generator))
