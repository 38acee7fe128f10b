"""The prompt-lookup (n-gram) drafter: matching, losslessness, and its place in the engine."""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.sampling import SamplingParams
from specdecode.core.types import ForwardMeter
from specdecode.drafters import NgramDrafter, resolve_draft
from specdecode.models.loading import wrap_model

from conftest import ARCHS


def _propose(context, k, **sizes):
    drafter = NgramDrafter(**sizes)
    drafter.begin(context, SamplingParams(), None, ForwardMeter())
    return drafter.propose(context, k).tokens.tolist()


def test_proposes_what_followed_the_most_recent_longest_match():
    #          0  1  2  3  4  5  6  7  8  9 10
    context = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    # the 3-gram [2, 6, 7] never occurred; the 2-gram [6, 7] last occurred at 6..7 -> 1, 2, 6
    assert _propose(context, 3) == [1, 2, 6]
    assert _propose(context, 1) == [1]
    # with min = max = 3 there is no match at all
    assert _propose(context, 3, min_ngram=3, max_ngram=3) == []
    # the continuation may run up to the end of the context, never past it
    assert _propose([4, 4], 5) == [4]
    assert _propose([1], 3) == []


def test_longer_matches_win_over_more_recent_shorter_ones():
    context = [1, 2, 3, 9, 9, 3, 7, 7, 1, 2, 3]
    # [1, 2, 3] occurred at 0 (then 9); [3] alone occurred more recently at 5 (then 7)
    assert _propose(context, 2, max_ngram=3) == [9, 9]
    assert _propose(context, 2, max_ngram=1) == [7, 7]


def test_context_is_tracked_incrementally():
    drafter = NgramDrafter()
    drafter.begin([1, 2, 3], SamplingParams(), None, ForwardMeter())
    assert drafter.propose([1, 2, 3, 1, 2], 2).tokens.tolist() == [3, 1]
    assert drafter.propose([1, 2, 3, 1, 2, 3, 4], 2).tokens.tolist() == []
    assert drafter.propose([1, 2, 3, 1], 2).tokens.tolist() == [2, 3]  # a shorter context


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_ngram_drafting_is_lossless_greedy(arch):
    target = ARCHS[arch](seed=0)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9] * 5, [30]]
    ar = SpeculativeDecoder(target)
    accepted = 0
    for k in range(1, 9):
        engine = SpeculativeDecoder(target, NgramDrafter(1, 3), k=k, k_policy="fixed")
        for prompt in prompts:
            result = engine.generate(prompt, max_new_tokens=40)
            assert result.token_ids == ar.generate(prompt, max_new_tokens=40).token_ids
            accepted += result.stats.accepted
            assert result.stats.drafted <= k * result.stats.steps
    assert accepted > 0  # the random models loop, so lookups hit


def test_ngram_spec_strings():
    assert resolve_draft("ngram", None).name == "ngram:1-3"
    assert resolve_draft("ngram:2-5", None).name == "ngram:2-5"
    for bad in ("ngram:", "ngram:3", "ngram:a-b"):
        with pytest.raises(ValueError, match="ngram:MIN-MAX"):
            resolve_draft(bad, None)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        resolve_draft("ngram:4-2", None)


def test_ngram_sampling_keeps_the_target_distribution():
    """Deterministic proposals: accepted with probability p(x), else drawn from p without x."""
    from test_sampling_lossless import chi_square, chi_square_limit

    vocab = 6
    target = ARCHS["llama"](seed=3, vocab=vocab)
    # every id occurs with a successor: after any first token the lookup proposes a draft
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 0, 1]
    with torch.no_grad():  # temperature 1: the joint of the 1st token and the 2nd (drafted)
        first = target(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
        after = torch.tensor([[*prompt, a] for a in range(vocab)])
        second = target(after).logits[:, -1].softmax(-1)  # [V, V]
    exact = (first[:, None] * second).flatten()
    engine = SpeculativeDecoder(wrap_model(target), NgramDrafter(1, 3), k=3, k_policy="fixed")
    counts = torch.zeros(vocab * vocab)
    for seed in range(3000):
        result = engine.generate(prompt, max_new_tokens=3, temperature=1.0, seed=seed)
        counts[result.token_ids[0] * vocab + result.token_ids[1]] += 1
        assert result.stats.drafted == 1  # k clamped to what is left after the prefill's token
    assert chi_square(counts, exact) < chi_square_limit(vocab * vocab)
