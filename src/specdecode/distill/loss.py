"""What the draft is trained to minimise at each answer position: a distance between the target's
next-token distribution, as cached (its top-k tokens and one tail bucket for the rest), and the
draft's over the same K + 1 buckets (DistillSpec compares both):

- `kl`: forward KL(p_target || q_draft) = sum over buckets of p log(p / q);
- `tv`: total variation = 1/2 sum over buckets of |p - q| (what bounds the acceptance rate of
  speculative sampling: acceptance = 1 - TV, per position).

The target's buckets are renormalised to sum to 1 (its top-k log-probabilities are float16).
"""

from __future__ import annotations

import torch


def distill_loss(
    logits: torch.Tensor,
    top_logprobs: torch.Tensor,
    top_ids: torch.Tensor,
    tail: torch.Tensor,
    kind: str = "kl",
) -> torch.Tensor:
    """Per position loss [T] of the draft's `logits` [T, V] (float32) against the target's
    `top_logprobs` [T, K], `top_ids` [T, K] and `tail` [T] (its mass outside the top K)."""
    ids = top_ids.long()
    lse = torch.logsumexp(logits, dim=-1)  # [T]
    logq_top = logits.gather(-1, ids) - lse[:, None]  # [T, K]
    # a finite "minus infinity": where the top K cover the vocabulary the tail is empty, and
    # logsumexp over -inf alone has no gradient but NaN
    outside = logits.scatter(-1, ids, -1e30)
    logq_tail = torch.logsumexp(outside, dim=-1) - lse  # [T]
    p_top = top_logprobs.float().exp()
    covered = ids.shape[-1] >= logits.shape[-1]
    p_tail = torch.zeros_like(tail, dtype=torch.float32) if covered else tail.float()
    total = p_top.sum(-1) + p_tail
    p_top, p_tail = p_top / total[:, None], p_tail / total
    if kind == "kl":
        top = torch.xlogy(p_top, p_top) - p_top * logq_top
        return top.sum(-1) + torch.xlogy(p_tail, p_tail) - p_tail * logq_tail
    if kind == "tv":
        q_tail = torch.zeros_like(p_tail) if covered else logq_tail.exp()
        return 0.5 * ((p_top - logq_top.exp()).abs().sum(-1) + (p_tail - q_tail).abs())
    raise ValueError(f"unknown loss {kind!r}: kl or tv")
