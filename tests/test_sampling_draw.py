"""`draw`, which every sampled token goes through: exactly the distribution it is given.

On the CPU it is an inverse CDF over blocks of `DRAW_BLOCK` entries (not PyTorch's multinomial),
so these tests put mass in several blocks, a block of zeros and a ragged last block. Seeded, so
deterministic; the thresholds pass the correct sampler with a wide margin and fail a wrong
distribution (checked too).
"""

from __future__ import annotations

import pytest
import torch

from specdecode.core.sampling import DRAW_BLOCK, draw, sample
from test_sampling_lossless import chi_square, chi_square_limit


def spread(vocab: int) -> torch.Tensor:
    """[vocab] probabilities on a few tokens in the first, third and last blocks (the second all
    zero), one of them rare, every other entry zero."""
    probs = torch.zeros(vocab)
    support = [0, 5, DRAW_BLOCK - 1, 2 * DRAW_BLOCK, 2 * DRAW_BLOCK + 7, vocab - 2]
    probs[support] = torch.tensor([3.0, 1.0, 2.0, 5.0, 0.5, 4.0])
    probs[3 * DRAW_BLOCK - 1] = 1e-3  # rare, still drawn in proportion
    return probs / probs.sum()


@pytest.mark.parametrize("vocab", [3 * DRAW_BLOCK + 300, 4 * DRAW_BLOCK])
def test_draws_follow_the_distribution_and_never_a_zero(vocab):
    probs = spread(vocab)
    tokens = draw(probs, 40000, torch.Generator().manual_seed(1))
    assert tokens.dtype == torch.int64 and tokens.shape == (40000,)
    counts = torch.bincount(tokens, minlength=vocab).double()
    cells = int((probs > 0).sum())
    assert chi_square(counts, probs.double()) < chi_square_limit(cells)  # zeros never drawn
    wrong = probs.clone()  # two tokens of different blocks swapped: the test would see it
    wrong[[5, 2 * DRAW_BLOCK]] = probs[[2 * DRAW_BLOCK, 5]]
    assert chi_square(counts, wrong.double()) > 10 * chi_square_limit(cells)


def test_small_vocabulary_weights_and_seeds():
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0])  # need not sum to 1
    tokens = draw(weights, 30000, torch.Generator().manual_seed(2))
    counts = torch.bincount(tokens, minlength=5).double()
    assert chi_square(counts, (weights / weights.sum()).double()) < chi_square_limit(3)
    again = draw(weights / weights.sum(), 30000, torch.Generator().manual_seed(2))
    assert torch.equal(tokens, again)  # scale-free: the same uniforms pick the same tokens
    one = sample(weights, torch.Generator().manual_seed(2))
    assert one.dim() == 0 and int(one) == int(tokens[0])


def test_a_uniform_rounded_up_to_the_total_takes_the_last_token_with_mass(monkeypatch):
    probs = spread(3 * DRAW_BLOCK + 300)
    probs[-2:] = 0.0  # the last block's last entries are zero
    monkeypatch.setattr(torch, "rand", lambda count, **_: torch.ones(count, dtype=torch.float64))
    assert draw(probs, 1, None).tolist() == [int(probs.nonzero().max())]


@pytest.mark.parametrize(
    "weights",
    [
        torch.zeros(10),
        torch.tensor([0.5, float("nan")]),
        torch.tensor([1.0, float("inf")]),
        torch.zeros(0),
    ],
)
def test_weights_that_are_no_distribution_are_refused(weights):
    with pytest.raises(ValueError, match="finite, non-negative, not all zero"):
        draw(weights, 1, None)
