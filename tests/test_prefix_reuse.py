"""A joining row starts from the prefix a freed row left behind (`LeanStore.open_row(tokens)`,
`PrefixPool` for the draft's caches): only the rest of its prompt is prefilled, and the keys,
values and answers are bit for bit those of a fresh prefill (docs/architecture.md, "Prefix
reuse")."""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.models.lean import PREFILL_CHUNK, VERIFY_TOKENS, LeanCache, LeanStore, PrefixPool
from specdecode.models.loading import wrap_model

from conftest import WIDE, char_tokenizer, needs_kernel, noisy_copy, on_kernel, tiny_llama


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(cache: LeanCache, tokens: list[int]) -> torch.Tensor:
    start = len(cache)
    with torch.inference_mode():
        return cache.forward(torch.tensor(tokens[start:]), last_only=True)


@pytest.fixture(scope="module")
def target():
    return on_kernel(tiny_llama(seed=0, layers=2, **WIDE))


@needs_kernel()
def test_a_kept_prefix_gives_the_keys_values_and_logits_of_a_fresh_prefill(target):
    store = LeanStore(target, rows=2, max_len=96)
    first, shared = _ids(40, 0), _ids(25, 1)
    row = store.open_row(first)
    assert len(row) == 0  # nothing to keep yet
    _prefill(row, shared + first)
    row.close()
    prompt = shared + _ids(30, 2)  # shares 25 tokens with what the row holds
    row = store.open_row(prompt)
    assert len(row) == 25
    logits = _prefill(row, prompt)
    fresh = LeanCache(target, VERIFY_TOKENS, residual=store.residual)
    want = _prefill(fresh, prompt)
    assert torch.equal(logits, want)
    n = len(prompt)
    assert torch.equal(row.kv[:, :, :, :n], fresh.kv[:, :, :, :n])
    assert row.ids[:n].tolist() == prompt


@needs_kernel()
def test_the_free_row_with_the_longest_prefix_is_taken_and_ties_go_to_the_oldest(target):
    store = LeanStore(target, rows=3, max_len=64)
    a, b = _ids(20, 3), _ids(20, 4)
    rows = [store.open_row() for _ in range(3)]
    _prefill(rows[0], a)
    _prefill(rows[1], a[:8] + b[8:])
    _prefill(rows[2], b)
    for row in rows:
        row.close()
    got = store.open_row(a[:12] + b[:5])  # row 0 holds 12 of it, row 1 8, row 2 none
    assert len(got) == 12 and got.ids[:3].tolist() == a[:3]
    other = store.open_row(_ids(10, 9))  # shares nothing: the row freed longest ago of 1, 2
    assert len(other) == 0 and other.ids[:3].tolist() == (a[:8] + b[8:])[:3]
    got.close()
    other.close()


@needs_kernel()
def test_no_prefix_is_kept_where_a_prefill_would_compute_it_otherwise(target):
    store = LeanStore(target, rows=1, max_len=2 * PREFILL_CHUNK)
    tokens = _ids(PREFILL_CHUNK + VERIFY_TOKENS + 40, 5)  # a second chunk too long to fuse
    row = store.open_row()
    _prefill(row, tokens)
    # the prompt is longer than a chunk: its own prefill would not take the fused path there
    assert row.reusable_prefix(tokens[: PREFILL_CHUNK + 1]) == 0
    assert row.reusable_prefix(tokens[:PREFILL_CHUNK]) == PREFILL_CHUNK
    # a long forward past the first chunk is not fused: positions from there on are not kept
    assert row.fused_len == PREFILL_CHUNK
    row.rollback(300)
    assert row.reusable_prefix(tokens[:400]) == 300
    row.close()
    # a model off the fused operations (float32) keeps nothing
    plain = LeanCache(tiny_llama(seed=0, layers=2, **WIDE))
    _prefill(plain, tokens[:20])
    assert plain.reusable_prefix(tokens[:20]) == 0


@needs_kernel()
def test_a_prefix_pool_hands_out_the_longest_and_keeps_at_most_size(target):
    pool = PrefixPool(2)
    a, b = _ids(30, 6), _ids(30, 7)
    caches = []
    for tokens in (a, b, a[:10] + b[:5]):
        cache = LeanCache(target)
        _prefill(cache, tokens)
        caches.append(cache)
        pool.put(cache)
    assert len(pool) == 2  # the oldest (over a) went
    assert pool.take(a[:20]) is caches[2] and len(caches[2]) == 10
    assert pool.take(_ids(5, 8)) is None
    assert pool.take([*b, 1]) is caches[1] and len(caches[1]) == 30
    assert len(pool) == 0


@needs_kernel()
def test_a_prefix_pool_keeps_more_than_its_size_within_its_budget(target):
    caches = []
    for seed in (20, 21, 22):
        cache = LeanCache(target)
        _prefill(cache, _ids(30, seed))
        caches.append(cache)
    one = caches[0].nbytes
    pool = PrefixPool(1, budget=int(2.5 * one))
    for cache in caches:
        pool.put(cache)
    assert len(pool) == 2 and pool.nbytes == 2 * one  # the oldest went for room
    assert pool.take(_ids(30, 20)) is None
    assert pool.take(_ids(30, 21)) is caches[1] and pool.nbytes == one


@pytest.fixture(scope="module")
def engines():
    tokenizer = char_tokenizer()
    base = tiny_llama(seed=5, layers=3, vocab=len(tokenizer), **WIDE)
    draft = on_kernel(noisy_copy(base, 0.05, seed=6), 4)
    target = wrap_model(on_kernel(base), tokenizer, name="tiny")
    return target, draft


SYSTEM = "You are a careful assistant. Answer briefly and exactly. "
# one row (max_batch=1): each prompt finds what the one before it left
PROMPTS = [SYSTEM + "the cat sat", SYSTEM + "the cat ran", SYSTEM + "the cat ran", "once"]


@needs_kernel()
@pytest.mark.parametrize("options", [{"k": 3, "k_policy": "fixed"}, {"tree": "dynamic:6,3,2"}, {}])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_that_keep_a_prefix_answer_as_alone(engines, options, temperature):
    target, draft = engines
    engine = SpeculativeDecoder(target, draft if options else None, **options)
    batch = engine.generate_batch(PROMPTS, 16, temperature=temperature, seed=3, max_batch=1)
    for prompt, result in zip(PROMPTS, batch, strict=True):
        alone = engine.generate(prompt, 16, temperature=temperature, seed=3)
        assert result.token_ids == alone.token_ids and result.text == alone.text
        assert result.stats.accepted == alone.stats.accepted
        assert alone.stats.cached_tokens == 0
    cached = [r.stats.cached_tokens for r in batch]
    shared = len(engine.encode_prompt(SYSTEM + "the cat "))
    assert cached[0] == 0 and cached[1] >= shared and cached[3] == 0
    assert cached[2] == len(batch[2].prompt_ids) - 1  # the same prompt again: all of it kept


@needs_kernel()
def test_a_drafter_starts_from_the_pool_and_drafts_as_from_a_fresh_cache(target):
    from specdecode.core.batch import fork_drafter
    from specdecode.core.sampling import SamplingParams
    from specdecode.core.types import ForwardMeter
    from specdecode.drafters.model import ModelDrafter

    base = ModelDrafter(on_kernel(noisy_copy(tiny_llama(seed=0, layers=2, **WIDE), 0.05), 4))
    pool = PrefixPool(4)
    first, second = _ids(30, 10), _ids(30, 10)[:20] + _ids(6, 11)
    drafters = []
    for prompt, prefixes in ((first, pool), (second, pool), (second, None)):
        drafter = fork_drafter(base)
        drafter.prefixes = prefixes
        # what its begin will prefill, by which a batch prices its drafting (Batch._pays)
        lacking = len(prompt) - 1 - (20 if prompt is second and prefixes is not None else 0)
        assert drafter.prefill_positions(prompt) == lacking
        drafter.begin(prompt, SamplingParams(), None, ForwardMeter())
        drafters.append(drafter)
        if prompt is first:
            left = drafter.cache
            drafter.end()
            assert drafter.cache is None and len(pool) == 1
    kept, fresh = drafters[1], drafters[2]
    assert kept.cache is left and len(kept.cache) == len(second) - 1
    assert kept.meter.tokens["draft_prefill"] == len(second) - 1 - 20
    got, want = kept.propose(second, 4), fresh.propose(second, 4)
    assert torch.equal(got.tokens, want.tokens)


def _served(engines, prompts: list[str], **options) -> tuple[list[int], str]:
    """Each prompt's `cached_tokens` from a server over the tiny pair (answered one after the
    other, each checked against the engine alone), then its /metrics."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from specdecode.server.app import create_app
    from specdecode.server.background import serve_in_thread

    target, draft = engines
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    reference = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    cached = []
    with serve_in_thread(create_app(engine, "tiny", **options)) as base:
        for prompt in prompts:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            out = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
            assert out["choices"][0]["text"] == reference.generate(prompt, 12).text
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        metrics = httpx.get(f"{base}/metrics").text
    return cached, metrics


def _metric(metrics: str, name: str) -> float:
    return float(next(line for line in metrics.splitlines() if line.startswith(name)).split()[-1])


@needs_kernel()
def test_the_server_reports_the_kept_prefix_in_usage_and_metrics(engines):
    # one after the other: the second finds the first's row
    cached, metrics = _served(engines, [SYSTEM + "the cat sat", SYSTEM + "the dog ran"])
    encode = SpeculativeDecoder(*engines).encode_prompt
    assert cached[0] == 0 and cached[1] >= len(encode(SYSTEM + "the "))
    assert _metric(metrics, "vllm:prefix_cache_hits_total") == sum(cached)


@needs_kernel()
@pytest.mark.parametrize("kept_bytes", [0, 2**24])
def test_a_prefix_a_row_gave_up_comes_back_from_the_prefix_cache(target, kept_bytes):
    store = LeanStore(target, rows=1, max_len=96, kept_bytes=kept_bytes)
    first = _ids(40, 12)
    other = [(first[0] + 1) % 90, *_ids(29, 13)]
    for tokens in (first, other):  # the one row: `other` takes it over, sharing nothing
        row = store.open_row(tokens)
        _prefill(row, tokens)
        row.close()
    prompt = [*first[:33], (first[33] + 1) % 90, *_ids(8, 14)]
    row = store.open_row(prompt)
    assert len(row) == (33 if kept_bytes else 0)
    assert len(store.kept) == (2 if kept_bytes else 0)  # each was kept when the row went on
    logits = _prefill(row, prompt)
    fresh = LeanCache(target, VERIFY_TOKENS, residual=store.residual)
    assert torch.equal(logits, _prefill(fresh, prompt))
    n = len(prompt)
    assert torch.equal(row.kv[:, :, :, :n], fresh.kv[:, :, :, :n])
    assert row.ids[:n].tolist() == prompt


@needs_kernel()
def test_a_draft_model_takes_its_share_of_the_prefix_cache(engines):
    from specdecode.models.lean import position_bytes

    target, draft = engines
    for drafter in (draft, None):
        engine = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed")
        session = engine.batch_session(2, 64, prefix_cache_mb=1)
        kept, draft_kept = session.prefix_cache.budget, session.draft_prefixes.budget
        assert kept + draft_kept == 2**20
        if drafter is None:
            assert draft_kept == 0
        else:  # both keep about as many positions
            per_target, per_draft = position_bytes(target.model), position_bytes(draft)
            assert abs(kept / per_target - draft_kept / per_draft) <= 1
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        engine.batch_session(2, 64, prefix_cache_mb=-1)


def test_the_cli_and_the_session_default_to_the_same_prefix_cache():
    from specdecode.runtime import session
    from specdecode.server import limits

    # repeated in limits.py so that the CLI starts without torch
    assert limits.DEFAULT_PREFIX_CACHE_MB == session.DEFAULT_PREFIX_CACHE_MB


def test_a_prefix_cache_keeps_the_longest_within_its_budget():
    from specdecode.models.prefix_cache import PrefixCache, common_prefix

    def kv(n: int, value: float) -> torch.Tensor:  # [layers, 2, Hkv, max_len, d]
        return torch.full((2, 2, 1, 64, 4), float(value))[:, :, :, :n]

    a, b = torch.arange(20), torch.arange(100, 120)
    one = kv(20, 0).numel() * 4 + 20 * 8  # bytes of a 20-position prefix
    cache = PrefixCache(int(2.5 * one))
    cache.keep(a[:10], kv(64, 1), None)
    cache.keep(a, kv(64, 2), None)  # covers the first: it goes
    cache.keep(a[:15], kv(64, 3), None)  # covered by `a`: nothing new
    assert len(cache) == 1 and cache.nbytes == one
    cache.keep(b, kv(64, 4), None)
    entry, n = cache.match([*range(12), 7])
    assert n == 12 and torch.equal(entry.kv, kv(20, 2))
    row_kv, row_ids = torch.zeros(2, 2, 1, 64, 4), torch.zeros(64, dtype=torch.long)
    cache.restore(entry, 12, row_kv, row_ids, None)  # `a` is now the most recently used
    assert torch.equal(row_kv[:, :, :, :12], kv(12, 2)) and row_kv[:, :, :, 12:].eq(0).all()
    assert row_ids[:12].tolist() == list(range(12))
    cache.keep(a + 200, kv(64, 5), None)  # over budget: the least recently used (b) goes
    assert len(cache) == 2 and cache.dropped == 1 and cache.nbytes <= cache.budget
    assert cache.match(b.tolist()) == (None, 0)
    assert common_prefix(a, [0, 1, 9]) == 2 and common_prefix(a, []) == 0
    assert cache.report() == {"prefixes": 2, "bytes": 2 * one, "budget": cache.budget, "dropped": 1}
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1)


@needs_kernel()
@pytest.mark.parametrize("prefix_cache_mb", [0, 64])
def test_the_server_keeps_prefixes_beyond_its_rows(engines, prefix_cache_mb):
    # one row: the second prompt (sharing nothing) takes over what the first left
    prompts = [SYSTEM + "the cat sat", "once upon a time", SYSTEM + "the cat sat"]
    cached, metrics = _served(engines, prompts, max_batch=1, prefix_cache_mb=prefix_cache_mb)
    whole = len(SpeculativeDecoder(*engines).encode_prompt(prompts[0])) - 1  # the last is run
    assert cached == [0, 0, whole if prefix_cache_mb else 0]
    assert (_metric(metrics, "specdecode_prefix_cache_bytes") > 0) == bool(prefix_cache_mb)
