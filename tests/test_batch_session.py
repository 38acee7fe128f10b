"""The engine's batches: `generate_batch` answers each prompt as `generate` does alone, and
`BatchSession` adds, steps and cancels generations over one store (docs/usage.md, "Many prompts
at once")."""

from __future__ import annotations

import pytest

from specdecode import SpeculativeDecoder
from specdecode.models.loading import wrap_model
from specdecode.request import GenerationRequest
from specdecode.sampling import SamplingParams
from specdecode.store import StoreFull

from conftest import char_tokenizer, noisy_copy, tiny_llama

PROMPTS = ["hello", "the cat sat", "a", "once upon a time"]


@pytest.fixture(scope="module")
def models():
    tokenizer = char_tokenizer()
    target = tiny_llama(seed=0, vocab=len(tokenizer))
    return wrap_model(target, tokenizer, name="tiny"), noisy_copy(target, 0.05)


@pytest.mark.parametrize("options", [{"k": 3}, {"tree": "dynamic:6,3,2"}, {}])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generate_batch_answers_each_prompt_as_alone(models, options, temperature):
    target, draft = models
    engine = SpeculativeDecoder(target, draft if options else None, **options)
    batch = engine.generate_batch(PROMPTS, 12, temperature=temperature, seed=3, max_batch=3)
    for prompt, result in zip(PROMPTS, batch, strict=True):
        alone = engine.generate(prompt, 12, temperature=temperature, seed=3)
        assert result.token_ids == alone.token_ids and result.text == alone.text
        assert result.stats.new_tokens == alone.stats.new_tokens
        assert result.stats.accepted == alone.stats.accepted
        assert result.prompt_ids == alone.prompt_ids


def test_generate_batch_stop_strings_end_their_row_only(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=3)
    plain = engine.generate(PROMPTS[1], 12).text
    stop = plain[3:5]
    batch = engine.generate_batch(PROMPTS[:2], 12, stop=stop)
    for prompt, result in zip(PROMPTS[:2], batch, strict=True):
        alone = engine.generate(prompt, 12, stop=stop)
        assert (result.text, result.token_ids) == (alone.text, alone.token_ids)
    assert batch[1].stats.stop_reason == "stop" and stop not in batch[1].text


def test_generate_batch_refuses_bad_input_before_running(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=3)
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate_batch([], 4)
    with pytest.raises(ValueError, match="non-empty list"):
        engine.generate_batch("a string", 4)
    with pytest.raises(ValueError, match="empty"):
        engine.generate_batch(["fine", ""], 4)
    with pytest.raises(ValueError, match="max_batch"):
        engine.generate_batch(["fine"], 4, max_batch=0)


def test_a_session_adds_steps_and_cancels(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=3)
    session = engine.batch_session(max_rows=2, max_len=64)
    request = GenerationRequest(10, SamplingParams())
    first = session.add(PROMPTS[0], request)
    second = session.add(PROMPTS[1], request)
    with pytest.raises(StoreFull):
        session.add(PROMPTS[2], request)
    with pytest.raises(ValueError, match="positions per sequence"):
        engine.batch_session(max_rows=1, max_len=8).add(PROMPTS[3], request)
    session.step()
    session.cancel(second)
    assert second.finished and second.finish_reason == "cancelled" and session.free_rows == 1
    third = session.add(PROMPTS[2], request)  # takes the freed row
    while session.generations:
        session.step()
    for prompt, generation in ((PROMPTS[0], first), (PROMPTS[2], third)):
        alone = engine.generate(prompt, 10)
        assert generation.token_ids == alone.token_ids
        assert generation.finish_reason in ("length", "stop")
    assert session.store_bytes > 0 and session.free_rows == 2
