"""Invariant 2: after every step the caches hold exactly what a fresh prefill would (a batch of
one row, stepped one step at a time)."""

from __future__ import annotations

import copy

import pytest
import torch

from specdecode.core.batch import Batch
from specdecode.core.cache import KVCache
from specdecode.core.policies import FixedK
from specdecode.core.sampling import SamplingParams, make_generator
from specdecode.core.types import Stats
from specdecode.drafters.model import ModelDrafter

from conftest import ARCHS, noisy_copy


def _next_logits_from_cache(model, cache: KVCache, last_token: int) -> torch.Tensor:
    probe = copy.deepcopy(cache)  # the probe must not grow the real cache
    with torch.no_grad():
        return probe.forward(torch.tensor([last_token]))[-1]


def _next_logits_fresh(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_caches_match_a_fresh_prefill_after_every_step(arch, temperature):
    target = ARCHS[arch](seed=0)
    draft_model = noisy_copy(target, 0.05)
    params = SamplingParams(temperature=temperature)
    generator = make_generator(torch.device("cpu"), 0)
    stats = Stats()
    prompt = [3, 1, 4, 1, 5]
    drafter = ModelDrafter(draft_model, vocab_size=96)
    batch = Batch(target, policy=FixedK(1), meter=stats.meter)
    row = batch.add(prompt, 200, drafter=drafter, params=params, generator=generator, stats=stats)
    state = row.state
    assert state.tokens == [*prompt, *row.committed] and len(state.target_cache) == len(prompt)
    accepted_counts = set()
    for step in range(12):
        k = batch.policy.k = 1 + step % 6
        drafted, accepted = stats.drafted, stats.accepted
        batch.step()
        depth, accepted = stats.drafted - drafted, stats.accepted - accepted
        assert depth == k and len(row.committed) == accepted + 1
        accepted_counts.add(accepted == k)
        tokens = state.tokens
        assert len(state.target_cache) == len(tokens) - 1
        torch.testing.assert_close(
            _next_logits_from_cache(target, state.target_cache, tokens[-1]),
            _next_logits_fresh(target, tokens),
            rtol=1e-4,
            atol=1e-4,
        )
        # the drafter's cache is a prefix of the committed tokens, never past them
        assert len(drafter.cache) <= len(tokens) - 1
        cached = len(drafter.cache)
        torch.testing.assert_close(
            _next_logits_from_cache(draft_model, drafter.cache, tokens[cached]),
            _next_logits_fresh(draft_model, tokens[: cached + 1]),
            rtol=1e-4,
            atol=1e-4,
        )
    assert accepted_counts == {True, False}, "both full acceptance and rejections happened"


def test_full_acceptance_catches_the_drafter_up_without_recomputing(llama_pair):
    target, _ = llama_pair
    params = SamplingParams()
    stats = Stats()
    prompt = [2, 7, 1, 8]
    drafter = ModelDrafter(target, vocab_size=96)  # identical draft: everything is accepted
    batch = Batch(target, policy=FixedK(4), meter=stats.meter)
    row = batch.add(prompt, 100, drafter=drafter, params=params, stats=stats)
    for _ in range(5):
        before = dict(stats.meter.tokens)
        batch.step()
        # k draft forwards, fed 1 (first step) or 2 (catch-up) + 3 tokens: never the prefix again
        fed = stats.meter.tokens["draft"] - before.get("draft", 0)
        assert fed <= 2 + 3
        assert len(drafter.cache) == len(row.state.tokens) - 2  # d_k and the bonus to feed
    assert stats.meter.calls["draft"] == 5 * 4
    assert stats.meter.calls["target"] == 5  # one target forward per step


def test_rollback_refuses_to_grow():
    cache = KVCache(ARCHS["llama"](seed=0))
    cache.forward(torch.tensor([1, 2, 3]))
    cache.rollback(2)
    assert len(cache) == 2
    cache.rollback(2)
    assert len(cache) == 2
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback(5)


def test_a_copied_prefill_decodes_like_a_fresh_one_and_stays_independent(llama_pair):
    from specdecode.core.decode import decode

    target, _ = llama_pair
    prompt = [3, 14, 15, 92, 65, 35]
    shared = KVCache(target)
    with torch.inference_mode():
        shared.forward(torch.tensor(prompt[:-1]), last_only=True)
    expected = [t for block in decode(target, prompt, 12) for t in block]
    for _ in range(2):  # the shared cache is never touched: every copy starts from the prompt
        copied = [t for block in decode(target, prompt, 12, prefilled=shared.copy()) for t in block]
        assert copied == expected
        assert len(shared) == len(prompt) - 1
    # a cache over a prefix of the prompt: only the rest is prefilled, the same answer
    longer = [*prompt, 7]
    prefix = [t for block in decode(target, longer, 12, prefilled=shared.copy()) for t in block]
    assert prefix == [t for block in decode(target, longer, 12) for t in block]
    with pytest.raises(ValueError, match="must cover at most the prompt but its last token"):
        next(decode(target, prompt[:-1], 4, prefilled=shared.copy()))


@pytest.mark.parametrize("forward", ["hf", "lean"])
def test_the_draft_prefill_builds_no_autograd_graph(forward, monkeypatch):
    # drafter.begin prefills the draft's cache: under inference mode, like every other forward
    # (with grad on it built a graph and sent the CPU kernel to its slow fallback)
    from specdecode.core.decode import decode
    from specdecode.models.lean import ENV

    monkeypatch.setenv(ENV, forward)

    target = ARCHS["llama"](seed=0)
    draft_model = noisy_copy(target, 0.05)
    assert any(p.requires_grad for p in draft_model.parameters())
    drafter = ModelDrafter(draft_model, vocab_size=96)
    blocks = decode(target, [3, 1, 4, 1, 5, 9, 2, 6], 4, drafter=drafter, k=2)
    next(blocks), next(blocks)  # the prefill's first token, then the first step
    if forward == "hf":
        layer = drafter.cache.hf.layers[0]
        assert layer.keys.is_inference() and not layer.keys.requires_grad
    else:
        assert not drafter.cache.kv.requires_grad
        logits = drafter.cache.forward(torch.tensor([1]), last_only=True)
        assert logits.is_inference() and not logits.requires_grad
