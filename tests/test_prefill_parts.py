"""A long prompt's prefill in parts (`BatchSession.open_prefill`, `advance_prefill`, then
`add(..., prefilled=...)`): the same answer, bit for bit, as its prefill at once; a server's
worker runs one part between two steps of the running rows (`prefill_chunk`), so a stream's
next token never waits for a whole long prefill (issue 55, item 9)."""

from __future__ import annotations

import itertools
import queue
import threading

import pytest

from specdecode import SpeculativeDecoder
from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams
from specdecode.models.loading import wrap_model

from conftest import WIDE, char_tokenizer, needs_kernel, noisy_copy, on_kernel, tiny_llama

pytestmark = needs_kernel()

SYSTEM = "You are a careful assistant. Answer briefly and exactly, in plain words. "
LONG = SYSTEM * 4 + "What does the cat do?"  # over 300 characters: over 300 tokens


@pytest.fixture(scope="module")
def engines():
    tokenizer = char_tokenizer()
    base = tiny_llama(seed=5, layers=3, vocab=len(tokenizer), max_position_embeddings=1024, **WIDE)
    draft = on_kernel(noisy_copy(base, 0.05, seed=6), 4)
    target = wrap_model(on_kernel(base), tokenizer, name="tiny")
    return target, draft


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_prompt_prefilled_in_parts_answers_as_at_once(engines, temperature):
    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    alone = engine.generate(LONG, 16, temperature=temperature, seed=3)
    session = engine.batch_session(max_rows=2, max_len=512)
    request = GenerationRequest(16, SamplingParams(temperature=temperature), seed=3)
    partial = session.open_prefill(LONG, request)
    assert session.free_rows == 1 and partial.kept == 0
    assert partial.remaining == len(alone.prompt_ids) - 1
    parts = 0
    while partial.remaining > 100:
        session.advance_prefill(partial, 100)
        parts += 1
    # the draft's prefill goes in the same parts: its first drafting step does only the rest
    meter = session.batch.meter
    assert meter.tokens["draft_prefill"] == 100 * parts and meter.calls["draft_prefill"] == parts
    generation = session.add(LONG, request, prefilled=partial)
    while session.generations:
        session.step()
    # (the draft begins after the first token: its prefill covers the prompt's last position)
    assert meter.tokens["draft_prefill"] == len(alone.prompt_ids)
    assert meter.calls["draft_prefill"] == parts + 1
    assert generation.token_ids == alone.token_ids
    assert generation.stats.accepted == alone.stats.accepted
    stats = generation.stats
    assert stats.cached_tokens == 0 and stats.meter.calls["prefill"] == parts + 1
    assert stats.meter.tokens["prefill"] == len(alone.prompt_ids)
    assert session.free_rows == 2


def test_a_draft_prefilled_after_the_first_token_in_parts_one_before_each_step(engines):
    # `draft_later` (the server's): the first token waits for the target's prefill alone; then
    # one part of the draft's before each step, the row drafting nothing until it is level
    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    alone = engine.generate(LONG, 40, eos_token_ids=())
    session = engine.batch_session(max_rows=2, max_len=512)
    request = GenerationRequest(40, SamplingParams(), eos_token_ids=())
    partial = session.open_prefill(LONG, request, parts=64, draft_later=True)
    while partial.remaining > 64:
        session.advance_prefill(partial, 64)
    meter = session.batch.meter
    assert "draft_prefill" not in meter.tokens
    generation = session.add(LONG, request, prefilled=partial, begin_draft=False)
    assert generation.new_ids == alone.token_ids[:1] and generation.row.waits_for_draft
    spent = []
    while session.generations:
        before = meter.tokens.get("draft_prefill", 0)
        session.step()
        spent.append(meter.tokens["draft_prefill"] - before)
        if generation.row.waits_for_draft:
            assert generation.stats.drafted == 0  # not before its draft is level
    parts = [n for n in spent if n]  # one a step
    assert all(n <= 64 for n in parts) and len(parts) >= (len(alone.prompt_ids) - 1) // 64
    assert spent[: len(parts)] == parts  # from the first step on
    assert generation.stats.drafted > 0 and generation.token_ids == alone.token_ids
    # its draft cache covers what it drafted from, the prompt's and the tokens since
    assert sum(spent) == meter.tokens["draft_prefill"] >= len(alone.prompt_ids) - 1


def test_a_row_that_ends_before_its_draft_is_level_leaves_the_draft_to_the_pool(engines):
    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    session = engine.batch_session(max_rows=1, max_len=512)
    request = GenerationRequest(3, SamplingParams(), eos_token_ids=())
    partial = session.open_prefill(LONG, request, parts=64, draft_later=True)
    generation = session.add(LONG, request, prefilled=partial, begin_draft=False)
    while session.generations:
        session.step()
    assert generation.stats.drafted == 0 and len(session.draft_prefixes) == 1
    again = session.open_prefill(LONG, request, parts=64, draft_later=True)
    assert len(again.draft) == 2 * 64  # the two parts it got: kept for the same prompt
    again.close()


def test_a_draft_that_would_not_pay_is_not_prefilled_in_parts(engines, monkeypatch):
    # the policy says no while the prompt goes in (a batch at k = 0, a short answer): the parts
    # leave the draft alone; says yes later: the row's first drafting step prefills it whole
    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    alone = engine.generate(LONG, 16)
    session = engine.batch_session(max_rows=2, max_len=512)
    request = GenerationRequest(16, SamplingParams())
    asked = []

    def pays(k, rows, remaining, prefill_s):
        asked.append((k, rows, remaining))
        return len(asked) > 2

    monkeypatch.setattr(session.batch.policy, "pays_to_begin", pays)
    partial = session.open_prefill(LONG, request)
    session.advance_prefill(partial, 100)
    session.advance_prefill(partial, 100)
    meter = session.batch.meter
    assert "draft_prefill" not in meter.tokens and asked == [(None, 1, 16)] * 2
    generation = session.add(LONG, request, prefilled=partial)
    while session.generations:
        session.step()
    assert meter.tokens["draft_prefill"] == len(alone.prompt_ids)  # in one, at the first step
    assert generation.token_ids == alone.token_ids
    assert generation.stats.accepted == alone.stats.accepted


def test_a_partial_prefill_keeps_a_prefix_and_gives_its_row_back(engines):
    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    session = engine.batch_session(max_rows=1, max_len=512)
    request = GenerationRequest(4, SamplingParams())
    first = session.add(LONG, request)
    while session.generations:
        session.step()
    # the same system prompt again: the free row keeps it, only the rest goes in parts
    partial = session.open_prefill(LONG.replace("cat", "dog"), request)
    assert partial.kept >= len(engine.encode_prompt(SYSTEM * 4))
    generation = session.add(LONG.replace("cat", "dog"), request, prefilled=partial)
    assert generation.stats.cached_tokens == partial.kept
    while session.generations:
        session.step()
    assert generation.token_ids == engine.generate(LONG.replace("cat", "dog"), 4).token_ids
    assert first.finished and session.free_rows == 1
    # abandoned, or handed to the wrong prompt: the row goes back
    partial = session.open_prefill(LONG, request)
    assert session.free_rows == 0
    partial.close()
    assert session.free_rows == 1
    partial = session.open_prefill(LONG, request)
    with pytest.raises(ValueError, match="its own prompt"):
        session.add("another prompt", request, prefilled=partial)
    assert session.free_rows == 1


def test_the_worker_runs_one_part_between_two_steps_of_a_running_stream(engines):
    from specdecode.server.worker import Finished, GenerationParams, GenerationWorker, Job

    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    worker = GenerationWorker(engine, max_batch=2, max_len=512, prefill_chunk=32)
    order: list[str] = []  # what the worker did, in order, while the short stream ran
    session = worker.session
    advance, step, add = session.advance_prefill, session.step, session.add

    def advance_logged(partial, tokens):
        order.append("part")
        advance(partial, tokens)

    def step_logged():
        order.append("step")
        return step()

    def add_logged(*args, **kwargs):  # the last part: the prompt's last token, the first new
        order.append("part" if kwargs.get("prefilled") is not None else "add")
        return add(*args, **kwargs)

    session.advance_prefill, session.step, session.add = advance_logged, step_logged, add_logged
    outcomes: dict[str, queue.Queue] = {"short": queue.Queue(), "long": queue.Queue()}
    started = threading.Event()

    def job(name: str, prompt: str, max_tokens: int) -> Job:
        params = GenerationParams(prompt, False, max_tokens, 0.0, None, None, None, [])

        def deliver(event):
            if name == "short":
                started.set()
            if isinstance(event, Finished):
                outcomes[name].put(event.outcome)

        return Job(params, "completions", deliver)

    worker.start()
    try:
        worker.submit(job("short", "once", 60))
        assert started.wait(60)
        worker.submit(job("long", LONG, 8))
        short, long = outcomes["short"].get(timeout=120), outcomes["long"].get(timeout=120)
    finally:
        worker.stop()
    assert short.token_ids == engine.generate("once", 60).token_ids
    assert long.token_ids == engine.generate(LONG, 8).token_ids
    parts = [i for i, what in enumerate(order) if what == "part"]
    # parts of at most 32 (fewer tokens when the measured cost per token grows), add's the last
    assert len(parts) >= (len(engine.encode_prompt(LONG)) - 1 - 1) // 32 + 1
    # while the short stream ran, never two parts without one of its steps between them
    assert all("step" in order[a:b] for a, b in itertools.pairwise(parts))


def test_later_parts_are_smaller_as_each_token_costs_more(engines):
    from specdecode.runtime.session import PartialPrefill
    from specdecode.server.worker import GenerationWorker

    target, draft = engines
    worker = GenerationWorker(SpeculativeDecoder(target, draft), max_len=512, prefill_chunk=128)
    partial = PartialPrefill(list(range(1000)), cache=None, kept=0, started=0.0)
    assert worker.part_size(partial) == 128  # the first part: the whole chunk
    partial.parts.append((128, 1.0))
    assert worker.part_size(partial) == 128
    partial.parts.append((128, 2.0))  # twice the cost per token: half the tokens
    assert worker.part_size(partial) == 64
    partial.parts.append((64, 4.0))  # never below a quarter of the chunk
    assert worker.part_size(partial) == 32
    partial.parts.append((32, 0.0))  # untimed: the whole chunk
    assert worker.part_size(partial) == 128
    with pytest.raises(ValueError, match="prefill_chunk"):
        GenerationWorker(SpeculativeDecoder(target, draft), prefill_chunk=-1)


VERY_LONG = SYSTEM * 8 + "What does the cat do?"  # over 600 tokens: past one chunk of 512


def _answer_in_parts(session, prompt: str, parts: int):
    """`prompt`'s answer through open_prefill with `parts`, offering parts of 200 (clamped),
    and the prompt positions a kept prefix covered (the target's, then the draft's)."""
    request = GenerationRequest(12, SamplingParams(), eos_token_ids=())  # drafts: no early EOS
    partial = session.open_prefill(prompt, request, parts=parts)
    kept, draft_kept = partial.kept, len(partial.draft)
    while partial.remaining > 0:
        session.advance_prefill(partial, 200)
    assert all(n <= parts for n, _ in partial.parts)
    generation = session.add(prompt, request, prefilled=partial)
    assert generation.stats.meter.tokens["prefill"] == len(generation.prompt_ids) - kept
    while session.generations:
        session.step()
    return generation, kept, draft_kept


def test_a_prompt_of_any_length_keeps_a_prefix_where_its_parts_stay_fused(engines):
    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    other = VERY_LONG.replace("cat", "dog")
    want, _, _ = _answer_in_parts(engine.batch_session(max_rows=1, max_len=800), other, 128)
    session = engine.batch_session(max_rows=1, max_len=800)
    _answer_in_parts(session, VERY_LONG, 128)  # leaves its keys and values in the row
    before = session.batch.meter.tokens["draft_prefill"]
    got, kept, draft_kept = _answer_in_parts(session, other, 128)
    shared = len(engine.encode_prompt(SYSTEM * 8))
    assert kept >= shared > 512
    assert got.token_ids == want.token_ids and got.stats.cached_tokens == kept
    # the draft's cache, prefilled in the same parts, keeps as much: its drafts are the ones
    # a fresh draft makes (the same acceptance), and only the rest of it is prefilled
    assert draft_kept >= shared and got.stats.accepted == want.stats.accepted
    spent = session.batch.meter.tokens["draft_prefill"] - before
    assert draft_kept < len(got.prompt_ids) and spent < len(got.prompt_ids) - 512
    # parts longer than the fused rows (VERIFY_TOKENS): such a prefill leaves the fused path
    # past one chunk, so nothing is kept
    session = engine.batch_session(max_rows=1, max_len=800)
    _answer_in_parts(session, VERY_LONG, 256)
    assert _answer_in_parts(session, other, 256)[1:] == (0, 0)


def test_a_hybrids_model_keeps_its_prefix_and_is_prefilled_in_parts(engines):
    # `MODEL+suffix`: its model's cache is a draft model's to the session (the same parts, the
    # same pool), so a long chat's next turn prefills only what neither kept
    from specdecode.drafters.factory import hybrid_drafter

    target, draft = engines
    engine = SpeculativeDecoder(target, hybrid_drafter(draft, target), k=3, k_policy="fixed")
    other = VERY_LONG.replace("cat", "dog")
    alone = SpeculativeDecoder(target).generate(other, 12, eos_token_ids=())
    session = engine.batch_session(max_rows=1, max_len=800)
    _, _, draft_kept = _answer_in_parts(session, VERY_LONG, 128)
    assert draft_kept == 0 and session.batch.meter.tokens["draft_prefill"] >= 512
    before = session.batch.meter.tokens["draft_prefill"]
    got, kept, draft_kept = _answer_in_parts(session, other, 128)
    assert kept > 512 and draft_kept > 512
    assert session.batch.meter.tokens["draft_prefill"] - before < len(got.prompt_ids) - 512
    assert got.token_ids == alone.token_ids
