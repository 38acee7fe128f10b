"""The engine's batches: `generate_batch` answers each prompt as `generate` does alone, and
`BatchSession` adds, steps and cancels generations over one store (docs/usage.md, "Many prompts
at once")."""

from __future__ import annotations

import pytest

from specdecode import SpeculativeDecoder
from specdecode.core.policies import FixedK
from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams
from specdecode.core.store import StoreFull
from specdecode.models.loading import wrap_model

from conftest import char_tokenizer, noisy_copy, tiny_llama

PROMPTS = ["hello", "the cat sat", "a", "once upon a time"]


@pytest.fixture(scope="module")
def models():
    tokenizer = char_tokenizer()
    target = tiny_llama(seed=0, vocab=len(tokenizer))
    return wrap_model(target, tokenizer, name="tiny"), noisy_copy(target, 0.05)


@pytest.mark.parametrize("options", [{"k": 3, "k_policy": "fixed"}, {"tree": "dynamic:6,3,2"}, {}])
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
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    plain = engine.generate(PROMPTS[1], 12).text
    stop = plain[3:5]
    batch = engine.generate_batch(PROMPTS[:2], 12, stop=stop)
    for prompt, result in zip(PROMPTS[:2], batch, strict=True):
        alone = engine.generate(prompt, 12, stop=stop)
        assert (result.text, result.token_ids) == (alone.text, alone.token_ids)
    assert batch[1].stats.stop_reason == "stop" and stop not in batch[1].text


def test_generate_batch_refuses_bad_input_before_running(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
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
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
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


def test_the_first_token_comes_from_the_prefill(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    alone = engine.generate(PROMPTS[1], 10)
    session = engine.batch_session(max_rows=2, max_len=64)
    request = GenerationRequest(10, SamplingParams())
    generation = session.add(PROMPTS[1], request, begin_draft=False)
    # before any step: the first token, its text, its time; the draft not yet prefilled
    assert generation.new_ids == alone.token_ids[:1] == generation.token_ids
    assert generation.new_text and alone.text.startswith(generation.new_text)
    assert generation.stats.steps == 0 and generation.stats.ttft_s > 0
    assert not generation.row.drafting and "draft_prefill" not in session.batch.meter.calls
    session.step()  # the first drafting step prefills the draft
    assert generation.row.drafting and session.batch.meter.calls["draft_prefill"] == 1
    while session.generations:
        session.step()
    assert generation.token_ids == alone.token_ids
    assert generation.stats.steps == alone.stats.steps and generation.stats.steps > 0
    # one token asked for: the prefill gives it, no step, the row is free at once
    one = session.add(PROMPTS[0], GenerationRequest(1, SamplingParams()))
    assert one.finished and one.finish_reason == "length" and one.stats.steps == 0
    assert one.token_ids == engine.generate(PROMPTS[0], 1).token_ids
    assert session.free_rows == 2 and not session.generations


def test_a_failing_draft_prefill_ends_its_generation_only(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    session = engine.batch_session(max_rows=2, max_len=64)
    request = GenerationRequest(10, SamplingParams())
    good = session.add(PROMPTS[0], request, begin_draft=False)
    bad = session.add(PROMPTS[1], request, begin_draft=False)

    def broken(*args, **kwargs):
        raise RuntimeError("draft prefill failed")

    bad.row.drafter.begin = broken  # this row's drafter only (each row has its own fork)
    assert session.step() == [good, bad]  # the step that would have drafted first
    assert bad.finished and bad.finish_reason == "error" and bad.row.drafter is None
    assert isinstance(bad.error, RuntimeError) and bad.stats.stop_reason == "error"
    assert session.free_rows == 1  # its store row is back
    while session.generations:
        session.step()
    assert good.token_ids == engine.generate(PROMPTS[0], 10).token_ids
    # generate_batch raises a row's error
    engine.drafter.__class__ = type("Broken", (type(engine.drafter),), {"begin": broken})
    with pytest.raises(RuntimeError, match="draft prefill failed"):
        engine.generate_batch(PROMPTS[:2], 10)


class Exploring(FixedK):
    """k = 2 every step, each step an exploration that begins no draft once acceptance is
    known (`knows`), as the cost policy's (`CostK.begins_drafts`)."""

    def __init__(self, knows: bool) -> None:
        super().__init__(2)
        self.knows = knows

    def begins_drafts(self) -> bool:
        return not self.knows


@pytest.mark.parametrize("knows", [True, False])
def test_an_exploration_pays_no_draft_prefill_once_acceptance_is_known(models, knows):
    # a row not yet drafting is not begun by a step that only refreshes an estimate; a row
    # begun before drafts in it; and without any acceptance known, the exploration begins rows
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=2, k_policy=Exploring(knows))
    session = engine.batch_session(max_rows=2, max_len=64)
    request = GenerationRequest(12, SamplingParams())
    fresh = session.add(PROMPTS[0], request, begin_draft=False)
    begun = session.add(PROMPTS[1], request, begin_draft=True)
    while session.generations:
        session.step()
    expected = SpeculativeDecoder(target).generate(PROMPTS[0], 12).token_ids
    assert fresh.token_ids == expected  # greedy: the target's own, either way
    assert fresh.row.drafting == (not knows)
    assert (set(fresh.stats.k_hist) == {0}) == knows and (fresh.stats.drafted == 0) == knows
    assert begun.row.drafting and begun.stats.drafted > 0
    assert session.batch.meter.calls["draft_prefill"] == (1 if knows else 2)
