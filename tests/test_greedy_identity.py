"""Invariant 1, greedy: speculative output is token for token the target's own greedy output."""

from __future__ import annotations

import pytest

from specdecode import SpeculativeDecoder

from conftest import ARCHS, noisy_copy, tiny_gpt2, tiny_llama

PROMPTS = [[1, 2, 3], [5] * 12, [11]]


def _drafts(target, arch_seed: int):
    return {
        "close": noisy_copy(target, 0.05, seed=arch_seed),  # agrees about half the time
        "far": noisy_copy(target, 0.15, seed=arch_seed + 1),  # disagrees often
        "unrelated": ARCHS["llama"](seed=99),  # another random model: almost never agrees
    }


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_speculative_greedy_equals_autoregressive(arch):
    target = ARCHS[arch](seed=0)
    ar = SpeculativeDecoder(target)
    references = {tuple(p): ar.generate(p, max_new_tokens=32).token_ids for p in PROMPTS}
    rates = {}
    for name, draft in _drafts(target, arch_seed=len(arch)).items():
        for k in range(1, 9):
            engine = SpeculativeDecoder(target, draft, k=k, k_policy="fixed")
            for prompt in PROMPTS:
                result = engine.generate(prompt, max_new_tokens=32)
                assert result.token_ids == references[tuple(prompt)], (name, k, prompt)
                assert result.stats.new_tokens == 32
                rates.setdefault(name, []).append(result.stats.acceptance_rate)
    # the drafts really exercise partial acceptance, not only all-or-nothing
    close = sum(rates["close"]) / len(rates["close"])
    assert 0.15 < close < 0.95, close
    assert sum(rates["far"]) / len(rates["far"]) < close


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("k", [1, 3, 8])
def test_identical_draft_accepts_everything(arch, k):
    target = ARCHS[arch](seed=1)
    expected = SpeculativeDecoder(target).generate([3, 4, 5], max_new_tokens=30).token_ids
    result = SpeculativeDecoder(target, target, k=k, k_policy="fixed").generate(
        [3, 4, 5], max_new_tokens=30
    )
    assert result.token_ids == expected
    assert result.stats.acceptance_rate == 1.0
    assert all(rate == 1.0 for rate in result.stats.per_position_acceptance)
    # after the prefill's first token, every step but the last (clamped to max_new_tokens)
    # emits k + 1 tokens
    assert result.stats.steps == -(-29 // (k + 1))


@pytest.mark.parametrize("seed", range(6))
def test_many_seeds_and_a_draft_of_another_architecture(seed):
    target = tiny_llama(seed=seed)
    draft = tiny_gpt2(seed=seed + 100)  # same vocabulary, different architecture
    prompt = [(seed * 7 + i) % 96 for i in range(1 + seed)]
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=25).token_ids
    for draft_model in (draft, noisy_copy(target, 0.05, seed=seed)):
        for k in (2, 5):
            got = SpeculativeDecoder(target, draft_model, k=k, k_policy="fixed").generate(
                prompt, max_new_tokens=25
            )
            assert got.token_ids == expected


def test_stream_yields_the_same_tokens_step_by_step(llama_pair):
    target, draft = llama_pair
    engine = SpeculativeDecoder(target, draft, k=4, k_policy="fixed")
    chunks = list(engine.stream([1, 2, 3], max_new_tokens=33))
    assert [t for c in chunks for t in c] == engine.generate([1, 2, 3], 33).token_ids
    assert all(1 <= len(c) <= 5 for c in chunks)
    assert len(chunks) == 1 + engine.last_stats.steps  # the prefill's first token, then steps
    assert len(chunks[0]) == 1
