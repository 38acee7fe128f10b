"""Invariant 1, sampling: speculative sampling draws exactly from the target's distribution.

Every test here is seeded, so it is deterministic; the thresholds are set so that the correct
algorithm passes with a wide margin and a wrong one (e.g. keeping the draft's tokens) fails, which
each test checks too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.sampling import SamplingParams, logits_to_probs
from specdecode.core.verify import verify_greedy, verify_sampling

from conftest import noisy_copy, tiny_llama


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed counts against expected probabilities (cells with p > 0)."""
    n = counts.sum()
    expected = probs * n
    support = probs > 0
    assert counts[~support].sum() == 0, "a token with zero target probability was emitted"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def chi_square_limit(cells: int) -> float:
    """Mean + 6 standard deviations of a chi-square with cells - 1 degrees of freedom."""
    df = cells - 1
    return df + 6 * (2 * df) ** 0.5


# -- the verification function on hand-made distributions ---------------------------------------


def _first_token_counts(p, q, draft_sampler, n=20000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        tokens = draft_sampler(gen)
        n_acc, nxt = verify_sampling(tokens, q, p, gen)
        counts[tokens[0] if n_acc > 0 else nxt] += 1
    return counts


P = torch.tensor(
    [[0.5, 0.2, 0.1, 0.1, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]]
)
Q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.2, 0.1], [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])


def test_verify_sampling_first_token_is_distributed_as_p():
    def draft_sampler(gen):
        return torch.stack([torch.multinomial(Q[i], 1, generator=gen)[0] for i in range(2)])

    counts = _first_token_counts(P, Q, draft_sampler)
    assert chi_square(counts, P[0]) < chi_square_limit(6)
    # the test has power: the draft's own tokens would fail it by far
    draft_counts = torch.bincount(
        torch.multinomial(
            Q[0], 20000, replacement=True, generator=torch.Generator().manual_seed(1)
        ),
        minlength=6,
    ).float()
    assert chi_square(draft_counts[P[0] > 0], P[0][P[0] > 0]) > 10 * chi_square_limit(6)


def test_verify_sampling_deterministic_proposal_is_distributed_as_p():
    proposal = torch.tensor([3, 5])  # q = None: one-hot on these tokens
    counts = _first_token_counts(P, None, lambda gen: proposal)
    assert chi_square(counts, P[0]) < chi_square_limit(6)


def test_verify_sampling_second_token_after_acceptance_is_distributed_as_p1():
    gen = torch.Generator().manual_seed(2)
    counts = torch.zeros(6)
    for _ in range(20000):
        tokens = torch.stack([torch.multinomial(Q[i], 1, generator=gen)[0] for i in range(2)])
        n_acc, nxt = verify_sampling(tokens, Q, P, gen)
        if n_acc >= 1:
            counts[tokens[1] if n_acc > 1 else nxt] += 1
    assert counts.sum() > 5000
    assert chi_square(counts, P[1]) < chi_square_limit(6)


def test_verify_sampling_edge_cases():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor([1, 4])
    same = P[:2]
    for _ in range(200):  # q == p: every draft is accepted
        assert verify_sampling(tokens, same, P, gen)[0] == 2
    zero = torch.tensor([[0.5, 0.0, 0.5, 0, 0, 0], [0.2] * 5 + [0.0], [1 / 6] * 6])
    for _ in range(200):  # p(x) == 0: always rejected, never emitted
        n_acc, nxt = verify_sampling(tokens, Q, zero, gen)
        assert n_acc == 0 and nxt in (0, 2)


def test_verify_greedy_hand_made():
    logits = torch.tensor([[0.0, 5, 1], [3, 0, 1], [0, 0, 9]])  # argmax: 1, 0, 2
    assert verify_greedy(torch.tensor([1, 0]), logits) == (2, 2)  # all accepted + bonus
    assert verify_greedy(torch.tensor([1, 2]), logits) == (1, 0)  # second rejected -> target's 0
    assert verify_greedy(torch.tensor([2, 0]), logits) == (0, 1)  # first rejected
    assert verify_greedy(torch.empty(0, dtype=torch.long), logits[:1]) == (0, 1)


def test_logits_to_probs_processing():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    full = logits.softmax(-1)
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0)), full)
    top2 = logits_to_probs(logits, SamplingParams(1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([full[0], full[1], 0, 0]) / full[:2].sum())
    # top-p keeps the smallest set holding p of the mass: 0.665 < 0.7, so two tokens are kept
    nucleus = logits_to_probs(logits, SamplingParams(1.0, top_p=0.7))
    assert torch.allclose(nucleus, top2)
    cold = logits_to_probs(logits, SamplingParams(0.5))
    assert torch.allclose(cold, (logits / 0.5).softmax(-1))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(1.0, top_p=0.0)


# -- end to end on a tiny model with a small vocabulary ------------------------------------------

VOCAB = 6
PROMPT = [1, 2, 3]


def exact_step_joint(model, params: SamplingParams, prompt: list[int] = PROMPT) -> torch.Tensor:
    """The model's exact distribution of its 2nd and 3rd sampled tokens after `prompt`
    ([V * V], index second * V + third): what the first step after the prefill decides (the
    prefill samples the 1st token alone; it is summed out here)."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params)  # [V]
        ones = torch.tensor([[*prompt, a] for a in range(vocab)])
        second = logits_to_probs(model(ones).logits[:, -1], params)  # [V(a), V(b)]
        pairs = torch.tensor([[*prompt, a, b] for a in range(vocab) for b in range(vocab)])
        third = logits_to_probs(model(pairs).logits[:, -1], params).view(vocab, vocab, vocab)
    return (first[:, None, None] * second[:, :, None] * third).sum(0).flatten()


def first_step_draws(
    engine: SpeculativeDecoder, params: SamplingParams, n: int, prompt: list[int] = PROMPT
) -> tuple[torch.Tensor, list]:
    """`engine`'s first step's two tokens over n generations (seeds 0 .. n-1) of 4 tokens after
    `prompt`: their counts ([V * V], index second * V + third, as `exact_step_joint`) and the
    GenerationResults (for the callers' own counters)."""
    vocab = engine.target.model.config.vocab_size
    counts = torch.zeros(vocab * vocab)
    results = []
    for seed in range(n):
        result = engine.generate(
            prompt,
            max_new_tokens=4,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
        )
        second, third = result.token_ids[1:3]  # the first step's (the 1st is the prefill's)
        counts[second * vocab + third] += 1
        results.append(result)
    return counts, results


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["t1", "t0.7-topk4", "t1.3-topp0.8"],
)
def test_speculative_sampling_matches_target_distribution(params):
    target = tiny_llama(seed=3, vocab=VOCAB)
    draft = noisy_copy(tiny_llama(seed=4, vocab=VOCAB), 0.0)  # an unrelated draft
    exact = exact_step_joint(target, params)
    engine = SpeculativeDecoder(target, draft, k=4, k_policy="fixed")
    n = 3000
    counts, results = first_step_draws(engine, params, n)
    assert (
        sum(r.stats.drafted for r in results) >= 2 * n
    )  # two drafts in the first step (k clamped by max_new_tokens = 4)
    limit = chi_square_limit(int((exact > 0).sum()))
    assert chi_square(counts, exact) < limit
    # power: n draws from the draft's own distribution would fail by far
    draft_joint = exact_step_joint(draft, params)
    on_support = exact > 0
    assert draft_joint[~on_support].sum() > 0.05 or (
        chi_square(draft_joint[on_support] * n, exact[on_support] / exact.sum()) > 5 * limit
    )


def test_seeded_sampling_is_reproducible(llama_pair):
    target, draft = llama_pair
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    runs = [engine.generate([4, 5], 30, temperature=1.0, seed=s).token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_all_prefixes_are_reachable():
    """Every 2-token continuation with target mass shows up: no systematic hole."""
    params = SamplingParams(temperature=2.0)
    target = tiny_llama(seed=5, vocab=4)
    draft = tiny_llama(seed=6, vocab=4)
    engine = SpeculativeDecoder(target, draft, k=2, k_policy="fixed")
    seen = {tuple(engine.generate([1], 2, temperature=2.0, seed=s).token_ids) for s in range(600)}
    assert seen == set(itertools.product(range(4), repeat=2))
    assert params.temperature == 2.0
