"""Invariant 3: stops are exact (max_new_tokens, EOS inside an accepted block, stop strings)."""

from __future__ import annotations

import pytest

from specdecode import SpeculativeDecoder

from conftest import char_tokenizer, noisy_copy, tiny_llama


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("max_new", [1, 2, 7, 13])
def test_never_more_than_max_new_tokens(llama_pair, k, max_new):
    target, draft = llama_pair
    expected = SpeculativeDecoder(target).generate([1, 2], max_new).token_ids
    for d in (draft, target):  # identical draft: max_new_tokens falls inside an accepted block
        result = SpeculativeDecoder(target, d, k=k, k_policy="fixed").generate([1, 2], max_new)
        assert result.token_ids == expected
        assert len(result.token_ids) == max_new == result.stats.new_tokens
        assert result.stats.stop_reason == "length"


@pytest.mark.parametrize("k", [2, 4, 8])
def test_eos_inside_an_accepted_block_ends_the_output(k):
    target = tiny_llama(seed=0)
    free = SpeculativeDecoder(target).generate([1, 2, 3], 40).token_ids
    # choose as EOS a token that first appears in the middle of the output
    pos = next(i for i, t in enumerate(free) if i >= 5 and t not in free[:i])
    eos = free[pos]
    expected = free[: pos + 1]
    ar = SpeculativeDecoder(target).generate([1, 2, 3], 40, eos_token_ids=[eos])
    assert ar.token_ids == expected and ar.stats.stop_reason == "eos"
    # an identical draft accepts every token, so EOS is met inside an accepted block
    spec = SpeculativeDecoder(target, target, k=k, k_policy="fixed").generate(
        [1, 2, 3], 40, eos_token_ids=[eos]
    )
    assert spec.token_ids == expected
    assert spec.stats.stop_reason == "eos"
    # every token but the prefill's first came from a step
    assert spec.stats.emitted == spec.stats.new_tokens - 1 == pos
    assert spec.stats.accepted <= spec.stats.drafted


def test_eos_from_the_model_config_is_used():
    target = tiny_llama(seed=0)
    free = SpeculativeDecoder(target).generate([1, 2, 3], 20).token_ids
    target.generation_config.eos_token_id = [free[4]]
    engine = SpeculativeDecoder(target, noisy_copy(target, 0.05), k=4, k_policy="fixed")
    assert engine.generate([1, 2, 3], 20).token_ids == free[: free.index(free[4]) + 1]
    assert engine.generate([1, 2, 3], 20, eos_token_ids=[]).token_ids == free


def test_stop_string_ends_the_output_inside_a_block():
    tokenizer = char_tokenizer()
    target = tiny_llama(seed=2, vocab=len(tokenizer))
    ar = SpeculativeDecoder(wrap(target, tokenizer))
    free = ar.generate("hello", 40, eos_token_ids=[])
    stop = free.text[10:12]
    cut = free.text.index(stop)
    for engine in (ar, SpeculativeDecoder(wrap(target, tokenizer), target, k=6, k_policy="fixed")):
        result = engine.generate("hello", 40, stop=[stop, "never-there"], eos_token_ids=[])
        assert result.text == free.text[:cut]
        # tokens run up to the one that completed the stop string
        n = next(
            m
            for m in range(1, 41)
            if stop in tokenizer.decode(free.token_ids[:m], skip_special_tokens=True)
        )
        assert result.token_ids == free.token_ids[:n]
        assert result.stats.stop_reason == "stop"
        assert result.stats.new_tokens == len(result.token_ids)


def wrap(model, tokenizer):
    from specdecode.models.loading import wrap_model

    return wrap_model(model, tokenizer)
