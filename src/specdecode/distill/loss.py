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
    """Per position loss [T] of the draft's `logits` [T, V] (float32 or bfloat16; computed in
    float32) against the target's `top_logprobs` [T, K], `top_ids` [T, K] and `tail` [T] (its
    mass outside the top K)."""
    ids = top_ids.long()
    logq = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [T, V]: one pass, fused
    logq_top = logq.gather(-1, ids)  # [T, K]
    covered = ids.shape[-1] >= logits.shape[-1]
    logq_tail = _log_tail(logq, logq_top, ids, covered)  # [T]
    p_top = top_logprobs.float().exp()
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


EXACT_TAIL = 1e-3  # below this draft tail mass, 1 - sum(q_top) loses too many digits in float32


def _log_tail(
    logq: torch.Tensor, logq_top: torch.Tensor, ids: torch.Tensor, covered: bool
) -> torch.Tensor:
    """log q_draft(outside the top K) [T] from its log-probabilities `logq` [T, V]: as
    log(1 - sum q_top), which costs nothing over the vocabulary; where that mass is under
    EXACT_TAIL (float32 keeps too few of its digits), by a log-sum-exp over the tokens outside
    the top K, for those positions only."""
    if covered:  # nothing outside: a finite "minus infinity" (-inf alone has NaN gradients)
        return torch.full_like(logq_top[:, 0], -1e30)
    tail = 1.0 - logq_top.exp().sum(-1)  # [T]
    exact = (tail < EXACT_TAIL).nonzero().squeeze(-1)  # [E] positions
    out = torch.log(tail.clamp(min=EXACT_TAIL))
    if exact.numel():
        outside = logq[exact].scatter(-1, ids[exact], -1e30)  # [E, V]
        out = out.index_put((exact,), torch.logsumexp(outside, dim=-1))
    return out
