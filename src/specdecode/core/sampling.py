"""Logits -> probabilities (temperature, top-k, top-p) and seeded sampling.

The same `SamplingParams` is applied to the target's and the drafter's logits, so that
verification compares the two distributions the tokens are really drawn from (invariant 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); top_k/top_p are then irrelevant
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (got {self.top_k})")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# A faster argmax over rows [R, V] -> [R] for contiguous CPU bfloat16 / float32 logits, equal to
# torch.argmax(-1): the CPU kernels register theirs when they load (kernels/build.py), so the core
# imports no kernel.
_argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None


def use_argmax_rows(argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Register (or, with None, drop) the argmax `greedy_tokens` runs CPU logits through."""
    global _argmax_rows
    _argmax_rows = argmax_rows


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] int64: the argmax over V, exactly `logits.argmax(-1)` (the first
    index of the largest value, or of the first NaN). Contiguous CPU bfloat16 / float32 logits go
    through the registered `use_argmax_rows` (the CPU kernels', once a model has loaded them:
    PyTorch's argmax is slow at a vocabulary's width on the CPU,
    docs/results.md); anything else through PyTorch."""
    if (
        _argmax_rows is None
        or logits.device.type != "cpu"
        or logits.dtype not in (torch.bfloat16, torch.float32)
        or logits.dim() == 0
        or logits.shape[-1] == 0
    ):
        return logits.argmax(-1)
    rows = logits.reshape(-1, logits.shape[-1]).contiguous()  # [R, V]
    return _argmax_rows(rows).reshape(logits.shape[:-1])


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, then top-p."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass;
        # the top token is always kept
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token id from [V] probabilities, as a 0-d int64 tensor (see `draw`)."""
    return draw(probs, 1, generator)[0]


# Entries per block of `draw`'s inverse CDF on the CPU: the draw finds its block among V / 1024
# block sums, then its token among the block's 1024 running sums.
DRAW_BLOCK = 1024


def draw(probs: torch.Tensor, count: int, generator: torch.Generator | None) -> torch.Tensor:
    """`count` independent token ids from [V] probabilities (or any non-negative weights: they
    need not sum to 1) -> [count] int64. An entry of zero is never drawn.

    On the CPU by the inverse CDF in float64, one uniform per draw: PyTorch's multinomial draws
    an exponential per vocabulary entry there, the largest cost of a sampled step after the
    forwards at a vocabulary of 150k (docs/results.md); elsewhere by
    `torch.multinomial`. Both are the distribution of `probs` exactly, up to float64 rounding of
    running sums; with the same generator state they draw different tokens."""
    if probs.device.type != "cpu":
        return torch.multinomial(probs, count, replacement=True, generator=generator)
    vocab = probs.shape[-1]
    whole = vocab - vocab % DRAW_BLOCK
    sums = [probs[:whole].reshape(-1, DRAW_BLOCK).sum(1, dtype=torch.float64)]
    if whole < vocab:
        sums.append(probs[whole:].sum(dtype=torch.float64).reshape(1))
    block_mass = torch.cat(sums) if len(sums) > 1 else sums[0]  # [ceil(V / DRAW_BLOCK)]
    block_end = block_mass.cumsum(0)  # running mass at each block's end
    total = float(block_end[-1]) if len(block_end) else 0.0
    if not 0.0 < total < float("inf"):
        raise ValueError(
            f"draw: the weights must be finite, non-negative, not all zero (sum {total})"
        )
    x = torch.rand(count, dtype=torch.float64, generator=generator) * total  # [count]
    blocks = torch.searchsorted(block_end, x, right=True).tolist()  # first block ending past x
    tokens = []
    for target, block in zip(x.reshape(-1, 1), blocks, strict=True):
        if block >= len(block_end):  # x rounded up to the total: the last block with mass
            block = int(block_mass.nonzero().max())
        start = block * DRAW_BLOCK
        weights = probs[start : start + DRAW_BLOCK]  # [<= DRAW_BLOCK]
        before = block_end[block - 1] if block else block_end.new_zeros(())
        ends = weights.to(torch.float64).cumsum(0) + before
        index = int(torch.searchsorted(ends, target, right=True))
        if index >= len(weights):  # the block's running sum fell a rounding short of x
            index = int(weights.nonzero().max())
        tokens.append(start + index)
    return torch.tensor(tokens, dtype=torch.int64)


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
