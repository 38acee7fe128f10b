"""GenerationRequest: one generation's options, checked in one place, run whole by the engine."""

from __future__ import annotations

import dataclasses

import pytest

from specdecode import GenerationRequest, SpeculativeDecoder
from specdecode.core.sampling import SamplingParams
from specdecode.models.loading import wrap_model

from conftest import char_tokenizer, noisy_copy, tiny_llama


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": 2.0}, "max_new_tokens must be an integer >= 1"),
        ({"stop": ""}, "stop strings must be non-empty"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
    ],
)
def test_bad_options_are_refused_when_the_request_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationRequest(**kwargs)


def test_options_are_normalised():
    request = GenerationRequest(stop="\n", eos_token_ids=[2, 2, 5])
    assert request.stop == request.stops == ("\n",)
    assert request.eos_token_ids == frozenset({2, 5})
    assert GenerationRequest().stops == () and GenerationRequest(stop=None).stops == ()
    assert GenerationRequest().eos_token_ids is None  # the model's EOS ids
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationRequest().max_new_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_generates_what_the_keyword_options_do(temperature):
    target = tiny_llama(seed=0)
    engine = SpeculativeDecoder(target, noisy_copy(target, 0.05), k=3, k_policy="fixed")
    options = dict(max_new_tokens=20, temperature=temperature, top_k=40, top_p=0.9, seed=3)
    by_keywords = engine.generate([1, 2, 3], **options, eos_token_ids=[])
    sampling = SamplingParams(temperature=temperature, top_k=40, top_p=0.9)
    request = GenerationRequest(20, sampling, seed=3, eos_token_ids=[])
    assert engine.generate_request([1, 2, 3], request).token_ids == by_keywords.token_ids
    streamed = [t for chunk in engine.stream_request([1, 2, 3], request) for t in chunk]
    assert streamed == by_keywords.token_ids
    assert engine.last_stats is not None and engine.last_stats.new_tokens == 20


def test_a_request_carries_stop_strings_and_the_chat_flag():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}u: {{ m['content'] }}\na: {% endfor %}"
    target = wrap_model(tiny_llama(seed=2, vocab=len(tokenizer)), tokenizer)
    engine = SpeculativeDecoder(target, target.model, k=4, k_policy="fixed")
    free = engine.generate("hello", 40, eos_token_ids=[], chat=True)
    stop = free.text[10:12]
    request = GenerationRequest(40, stop=stop, eos_token_ids=(), chat=True)
    result = engine.generate_request("hello", request)
    assert result.prompt_ids == free.prompt_ids != engine.encode_prompt("hello")  # the template
    assert result.text == free.text[: free.text.index(stop)]
    assert result.stats.stop_reason == "stop"


def test_a_request_is_checked_against_the_model_before_the_first_token():
    engine = SpeculativeDecoder(tiny_llama(seed=0))  # no tokenizer, a 256-token context
    with pytest.raises(ValueError, match="exceeds the target's context of 256 tokens"):
        engine.stream_request([1, 2, 3], GenerationRequest(300))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.stream_request([1, 2, 3], GenerationRequest(5, stop="x"))
