"""The batched core (batch.py): each row of a ragged batch is exactly its prompt decoded alone.

Rows differ in prompt length, max_new_tokens, accept counts, sampling parameters and drafter
(chains, token trees, none); they join mid-flight, finish early (EOS, length) or are removed, and
every row's tokens and Stats equal decode() of that row alone (float32: exact tokens). Sampled
rows of a mixed batch draw from the target's distribution (chi-square, as in
test_sampling_lossless.py). CostK chooses k per batch size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from specdecode.core.batch import Batch, Row, fork_drafter
from specdecode.core.cache import KVCache
from specdecode.core.decode import decode
from specdecode.core.policies import CostK, FixedK
from specdecode.core.sampling import SamplingParams, make_generator
from specdecode.core.store import StaticStore
from specdecode.core.types import ForwardMeter, Stats
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.tree_model import TreeModelDrafter
from specdecode.drafters.tree_shape import parse_tree_spec
from test_sampling_lossless import VOCAB, chi_square, chi_square_limit, exact_step_joint

from conftest import noisy_copy, tiny_llama, tiny_qwen2

GREEDY = SamplingParams()
# every counter a step fills (Stats.meter and the caller's timings aside)
STAT_FIELDS = (
    "steps",
    "drafted",
    "accepted",
    "emitted",
    "new_tokens",
    "stop_reason",
    "drafted_at",
    "accepted_at",
    "nodes_verified",
    "k_hist",
    "k_max",
    "k_policy",
    "prompt_tokens",
)


@dataclass
class Job:
    """One row of a test batch: what it decodes and when it joins or leaves."""

    prompt: list[int]
    max_new: int
    join: int = 0  # joins before the batch's step number `join` (0: from the start)
    params: SamplingParams = GREEDY
    seed: int | None = None  # a generator of its own, seeded
    eos: tuple[int, ...] = ()
    remove: int | None = None  # removed after the batch's step number `remove`


@dataclass
class Outcome:
    tokens: list[int]
    stats: Stats
    row: Row | None = None


def _generator(target, seed: int | None) -> torch.Generator | None:
    return None if seed is None else make_generator(next(target.parameters()).device, seed)


def alone(target, job: Job, drafter, k: int = 3, new_cache=KVCache) -> Outcome:
    """The job decoded alone (decode: a batch of one, the model's own cache), FixedK(k)."""
    stats = Stats()
    chunks = decode(
        target,
        job.prompt,
        job.max_new,
        drafter=fork_drafter(drafter),
        k_policy=FixedK(k),
        params=job.params,
        generator=_generator(target, job.seed),
        eos_token_ids=job.eos,
        stats=stats,
        new_cache=new_cache,
    )
    return Outcome([t for chunk in chunks for t in chunk], stats)


def batched(
    target,
    jobs: list[Job],
    drafter,
    *,
    policy=None,
    new_cache=KVCache,
    logits=None,
    begin_draft: bool = True,
) -> list[Outcome]:
    """Every job in one Batch (each row with its own fork of `drafter`), joining and leaving
    when its Job says; each row's committed tokens collected step by step (and, given
    `logits`, a list per job, the target's logits its `on_logits` was handed). `begin_draft`:
    Batch.add's (False: a row's draft begins in its first drafting step, as the server's)."""
    batch = Batch(target, policy=policy or FixedK(3), new_cache=new_cache)
    outcomes: dict[int, Outcome] = {}
    index: dict[Row, int] = {}
    step = 0
    while True:
        for i, job in enumerate(jobs):
            if job.join == step and i not in outcomes:
                stats = Stats()
                row = batch.add(
                    job.prompt,
                    job.max_new,
                    drafter=fork_drafter(drafter),
                    params=job.params,
                    generator=_generator(target, job.seed),
                    eos_token_ids=job.eos,
                    stats=stats,
                    on_logits=None if logits is None else logits[i].append,
                    begin_draft=begin_draft,
                )
                # the prefill's first token is the row's first committed block
                outcomes[i], index[row] = Outcome(list(row.committed), stats, row), i
        if not batch.running() and all(job.join <= step for job in jobs):
            break
        for row in batch.step():
            outcomes[index[row]].tokens.extend(row.committed)
        step += 1
        for i, job in enumerate(jobs):
            if job.remove == step:
                batch.remove(outcomes[i].row)
    return [outcomes[i] for i in range(len(jobs))]


def assert_rows_decode_alone(target, jobs, drafter, *, k: int = 3, new_cache=KVCache, **kw):
    """Each batched row's tokens and Stats equal the job decoded alone; returns the rows."""
    got = batched(target, jobs, drafter, policy=FixedK(k), new_cache=new_cache, **kw)
    for i, (job, row) in enumerate(zip(jobs, got, strict=True)):
        want = alone(target, job, drafter, k)
        if job.remove is not None:  # cut short: a prefix of its own decode
            assert row.tokens == want.tokens[: len(row.tokens)], i
            continue
        assert row.tokens == want.tokens, i
        for name in STAT_FIELDS:
            assert getattr(row.stats, name) == getattr(want.stats, name), (i, name)
    return got


# ragged: prompt lengths 5, 2, 8, 1; max_new_tokens 20, 7, 15, 12; two join after two steps
RAGGED = [
    Job([1, 2, 3, 4, 5], 20),
    Job([7, 8], 7),
    Job([9, 10, 11, 12, 13, 14, 15, 16], 15, join=2),
    Job([3], 12, join=2),
]


@pytest.fixture(scope="module")
def llama():
    target = tiny_llama(0)
    return target, noisy_copy(target, 0.05)


def _store(target, rows: int = 4, max_len: int = 64):
    store = StaticStore(target, rows=rows, max_len=max_len)
    return store, (lambda model: store.open_row())


# -- greedy rows: identical to each decoded alone ---------------------------------------------


def test_ragged_greedy_rows_in_a_static_store_decode_as_alone(llama):
    target, draft = llama
    store, new_cache = _store(target)
    got = assert_rows_decode_alone(target, RAGGED, ModelDrafter(draft), new_cache=new_cache)
    assert [len(o.tokens) for o in got] == [20, 7, 15, 12]
    assert [o.stats.stop_reason for o in got] == ["length"] * 4
    accepts = {o.stats.accepted / o.stats.drafted for o in got}
    assert len(accepts) == 4 and min(accepts) < 0.7  # different accept counts per row
    assert store.free_rows == 0  # finished rows keep their store rows until removed


def test_ragged_rows_on_the_models_own_cache(llama):
    """No store: forward_rows runs each KVCache's own forward, same answers."""
    target, draft = llama
    assert_rows_decode_alone(target, RAGGED, ModelDrafter(draft))


def test_rows_with_confidence_stops_decode_as_alone(llama):
    """Drafts cut short by the draft's confidence, row by row, in one forward per depth."""
    target, draft = llama
    _, new_cache = _store(target)
    got = assert_rows_decode_alone(
        target, RAGGED, ModelDrafter(draft, confidence=0.2), k=5, new_cache=new_cache
    )
    # rows stop at different depths: one drafts up to 4 tokens, others stop after 1
    assert [len(o.stats.drafted_at) for o in got] == [4, 1, 1, 1]


def test_qwen2_rows_decode_as_alone():
    target = tiny_qwen2(0)
    _, new_cache = _store(target)
    assert_rows_decode_alone(
        target, RAGGED, ModelDrafter(noisy_copy(target, 0.05)), new_cache=new_cache
    )


def test_ngram_rows_decode_as_alone(llama):
    target, _ = llama
    _, new_cache = _store(target)
    jobs = [
        Job([1, 2, 3, 1, 2, 3, 1, 2], 18),
        Job([4, 5, 4, 5, 4], 9),
        Job([6, 7, 8, 9, 6, 7], 14, join=1),
        Job([5, 5, 5], 11, join=3),
    ]
    got = assert_rows_decode_alone(target, jobs, NgramDrafter(1, 3), new_cache=new_cache)
    assert sum(o.stats.drafted for o in got) > 0  # prompt lookup found matches


def test_early_exit_rows_decode_as_alone():
    target = tiny_llama(1, layers=3)
    _, new_cache = _store(target)
    got = assert_rows_decode_alone(
        target, RAGGED, EarlyExitDrafter(target, 2), k=2, new_cache=new_cache
    )
    assert sum(o.stats.accepted for o in got) > 0


def test_plain_batched_decoding_without_a_drafter(llama):
    target, _ = llama
    _, new_cache = _store(target)
    got = assert_rows_decode_alone(target, RAGGED, None, new_cache=new_cache)
    for outcome, job in zip(got, RAGGED, strict=True):
        # the prefill's first token, then one token per step
        assert outcome.stats.steps == job.max_new - 1
        assert outcome.stats.drafted == 0 and outcome.stats.k_hist == {0: job.max_new - 1}


def test_rows_without_a_drafter_mix_with_drafting_rows(llama):
    """A row that does not draft (no drafter) takes plain steps in a drafting batch."""
    target, draft = llama
    _, new_cache = _store(target)
    batch = Batch(target, policy=FixedK(3), new_cache=new_cache)
    plain = batch.add(RAGGED[0].prompt, 10)
    spec = batch.add(RAGGED[1].prompt, 10, drafter=ModelDrafter(draft))
    out: dict[Row, list[int]] = {row: list(row.committed) for row in (plain, spec)}
    while batch.running():
        for row in batch.step():
            out[row].extend(row.committed)
    for row, job, drafter in ((plain, RAGGED[0], None), (spec, RAGGED[1], ModelDrafter(draft))):
        want = alone(target, dataclasses.replace(job, max_new=10), drafter)
        assert out[row] == want.tokens
        for name in STAT_FIELDS:
            assert getattr(row.stats, name) == getattr(want.stats, name), name
    assert plain.stats.drafted == 0 and spec.stats.drafted > 0


def test_an_eos_ends_its_row_and_the_others_continue(llama):
    target, draft = llama
    drafter = ModelDrafter(draft)
    first = alone(target, RAGGED[0], drafter).tokens
    # the first token row 0 emits mid-way and not before
    at = next(i for i in range(4, len(first)) if first[i] not in first[:i])
    eos = first[at]
    jobs = [dataclasses.replace(job, eos=(eos,)) for job in RAGGED]
    _, new_cache = _store(target)
    got = assert_rows_decode_alone(target, jobs, drafter, new_cache=new_cache)
    assert got[0].tokens == first[: at + 1] and got[0].stats.stop_reason == "eos"
    assert any(o.stats.stop_reason == "length" for o in got)
    for outcome, job in zip(got, jobs, strict=True):
        ended = outcome.stats.stop_reason == "eos"
        assert (outcome.tokens[-1] == eos) == ended
        assert eos not in outcome.tokens[:-1]
        assert len(outcome.tokens) == job.max_new or ended


def test_a_row_removed_mid_flight_leaves_the_others_alone_and_frees_its_store_row(llama):
    target, draft = llama
    store, new_cache = _store(target, rows=3)
    # row 1 leaves after 2 steps; row 3 can only join into its freed store row
    jobs = [
        Job([1, 2, 3, 4, 5], 20),
        Job([7, 8], 30, remove=2),
        Job([9, 10, 11], 15),
        Job([3], 12, join=3),
    ]
    got = assert_rows_decode_alone(target, jobs, ModelDrafter(draft), new_cache=new_cache)
    removed = got[1]
    assert 2 <= len(removed.tokens) < 30
    assert removed.row.state.target_cache.closed
    assert got[3].row.state.target_cache.row == removed.row.state.target_cache.row
    assert store.free_rows == 0


def test_a_row_with_no_new_tokens_is_done_at_once(llama):
    target, draft = llama
    batch = Batch(target, policy=FixedK(3))
    row = batch.add([1, 2, 3], 0, drafter=ModelDrafter(draft))
    assert row.done and row.stats.stop_reason == "length" and batch.step() == []
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        batch.add([1, 2, 3], -1)


# -- sampled rows mixed with greedy ones --------------------------------------------------------


MIXED = [
    Job([1, 2, 3, 4, 5], 20, params=SamplingParams(1.0), seed=11),
    Job([7, 8], 14),
    Job([9, 10, 11, 12, 13, 14, 15, 16], 15, params=SamplingParams(0.7, top_k=8), seed=12),
    Job([3], 12, join=2, params=SamplingParams(1.2, top_p=0.9), seed=13),
    Job([4, 4], 9, join=3),
]


def test_sampled_rows_mixed_with_greedy_rows_decode_as_alone_with_their_seeds(llama):
    target, draft = llama
    _, new_cache = _store(target, rows=5)
    got = assert_rows_decode_alone(target, MIXED, ModelDrafter(draft), new_cache=new_cache)
    # the seeds matter: another seed gives another answer
    other = alone(target, dataclasses.replace(MIXED[0], seed=99), ModelDrafter(draft))
    assert other.tokens != got[0].tokens


def test_sampled_rows_of_a_mixed_batch_follow_the_targets_distribution():
    """The first step's two tokens of many sampled rows (one seed each, half of them joining a
    running batch, next to greedy rows of other lengths) against the target's exact joint
    distribution. A one-token prompt: a one-token prefill, so many rows are cheap."""
    params, prompt = SamplingParams(temperature=1.0), [2]
    target = tiny_llama(seed=3, vocab=VOCAB)
    draft = tiny_llama(seed=4, vocab=VOCAB)  # an unrelated draft: many rejections
    exact = exact_step_joint(target, params, prompt)
    rows_per_batch, batches = 300, 8
    counts = torch.zeros(VOCAB * VOCAB)
    drafted = 0
    for b in range(batches):
        store = StaticStore(target, rows=rows_per_batch + 2, max_len=16)
        batch = Batch(target, policy=FixedK(4), new_cache=lambda m, s=store: s.open_row())
        batch.add([5, 4, 3, 2, 1, 0, 5], 8, drafter=ModelDrafter(draft))  # greedy
        sampled = []
        for r in range(rows_per_batch):
            if r == rows_per_batch // 2:  # the second half joins a batch already running
                batch.step()
                batch.add([1, 3], 6, drafter=ModelDrafter(draft))  # greedy
            gen = make_generator(torch.device("cpu"), b * rows_per_batch + r)
            row = batch.add(prompt, 4, drafter=ModelDrafter(draft), params=params, generator=gen)
            sampled.append(row)
        while batch.running():
            batch.step()
        for row in sampled:
            # the first step's two tokens, after the prefill's
            second, third = row.state.tokens[len(prompt) + 1 : len(prompt) + 3]
            counts[second * VOCAB + third] += 1
            drafted += row.stats.drafted
    n = rows_per_batch * batches
    assert drafted >= 2 * n  # two drafts in every sampled row's first step
    limit = chi_square_limit(int((exact > 0).sum()))
    assert chi_square(counts, exact) < limit
    # power: the draft's own distribution is far from the target's
    assert chi_square(exact_step_joint(draft, params, prompt) * n, exact) > 5 * limit


# -- token trees per row ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["static:2,2,1", "dynamic:6,3,2"])
def test_tree_rows_decode_as_alone(llama, spec):
    target, draft = llama
    _, new_cache = _store(target, rows=5)
    drafter = TreeModelDrafter(draft, parse_tree_spec(spec))
    jobs = [
        *RAGGED,
        Job([2, 3, 4], 3, join=1),  # after the prefill's token, room for a tree of depth 1 only
    ]
    got = assert_rows_decode_alone(target, jobs, drafter, new_cache=new_cache)
    assert all(o.stats.nodes_verified > 0 for o in got)
    assert got[-1].stats.drafted_at == [1]  # a tree of depth 1, then the last token alone


def test_tree_rows_mixed_with_rows_without_room_to_draft(llama):
    target, draft = llama
    _, new_cache = _store(target, rows=6)
    drafter = TreeModelDrafter(draft, parse_tree_spec("static:3,2"))
    jobs = [
        Job([1, 2, 3, 4, 5], 16),
        Job([7, 8], 1),  # one token: the prefill's, no step, nothing drafted
        Job([9, 10, 11], 1, join=1),
        Job([3], 12, params=SamplingParams(1.0), seed=5),  # a sampled tree
        Job([6, 6, 6, 6], 2, join=2),
    ]
    got = assert_rows_decode_alone(target, jobs, drafter, new_cache=new_cache)
    for short in (got[1], got[2]):
        assert len(short.tokens) == 1 and short.stats.drafted == 0
        assert short.stats.nodes_verified == 0 and short.stats.steps == 0
        assert short.stats.k_hist == {}


# -- the target's logits before each committed token (on_logits) -----------------------------


@pytest.mark.parametrize("kind", ["none", "chain", "tree"])
def test_on_logits_are_the_targets_own_before_each_committed_token(llama, kind):
    """Each row's `on_logits` gets, commit by commit, the target's raw logits before every token
    it committed (prefill's first token, accepted drafts, the recovered or bonus token; not past
    an EOS): those of one teacher-forced forward over prompt + output, greedy and sampled."""
    target, draft = llama
    drafter = {
        "none": None,
        "chain": ModelDrafter(draft),
        "tree": TreeModelDrafter(draft, parse_tree_spec("dynamic:6,3,2")),
    }[kind]
    eos = alone(target, RAGGED[0], ModelDrafter(draft)).tokens[6]  # ends row 0 early
    jobs = [
        dataclasses.replace(RAGGED[0], eos=(eos,)),
        dataclasses.replace(RAGGED[1], params=SamplingParams(0.8), seed=3),
        RAGGED[2],
    ]
    _, new_cache = _store(target)
    kept: list[list[torch.Tensor]] = [[] for _ in jobs]
    outcomes = batched(target, jobs, drafter, new_cache=new_cache, logits=kept)
    assert outcomes[0].tokens[-1] == eos and len(outcomes[0].tokens) < jobs[0].max_new
    for job, outcome, chunks in zip(jobs, outcomes, kept, strict=True):
        got = torch.cat(chunks)  # [T, V]
        ids = torch.tensor([job.prompt + outcome.tokens])
        with torch.no_grad():
            want = target(input_ids=ids).logits[0, len(job.prompt) - 1 : -1]  # [T, V]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# -- Stats per row and what the policy is told --------------------------------------------------


class Recording(FixedK):
    """FixedK that records what a batch tells `observe_step`."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.steps: list[tuple[list[tuple[int, int]], int]] = []

    def observe_step(self, rows, draft_s, target_s, verified) -> None:
        assert draft_s is None and target_s is None  # untimed
        self.steps.append((list(rows), verified))


def test_the_policy_learns_each_rows_depth_and_acceptance(llama):
    target, draft = llama
    policy = Recording(3)
    batch = Batch(target, policy=policy)
    rows = [batch.add(job.prompt, job.max_new, drafter=ModelDrafter(draft)) for job in RAGGED]
    while batch.running():
        before = [(r.stats.drafted, r.stats.accepted) for r in batch.running()]
        batch.step()
        told, verified = policy.steps[-1]
        assert len(told) == len(before)
        assert verified == sum(d + 1 for d, _ in told)  # chains: k' + 1 rows each
    per_row_drafted = sum(r.stats.drafted for r in rows)
    assert sum(d for told, _ in policy.steps for d, _ in told) == per_row_drafted
    assert sum(a for told, _ in policy.steps for _, a in told) == sum(
        r.stats.accepted for r in rows
    )


class Scripted(FixedK):
    """The ks of a script, step by step; records the draft seconds each step reports."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(max(ks))
        self.ks, self.draft_s = list(ks), []

    def next_k(self, max_k_allowed: int) -> int:
        return min(self.ks.pop(0), max_k_allowed)

    def observe_step(self, rows, draft_s, target_s, verified) -> None:
        self.draft_s.append(draft_s if rows[0][0] else "no draft")


def test_a_step_that_catches_up_after_steps_without_drafting_is_not_timed(llama):
    # after four steps at k = 0 the draft's cache lacks their tokens: the next chain's first
    # forward feeds them too, which says nothing of what one drafted depth costs
    target, draft = llama
    policy = Scripted([2, 2, 0, 0, 0, 0, 2, 2, 1, 1])
    ticks = iter(range(10_000))
    batch = Batch(target, policy=policy, meter=ForwardMeter(lambda: float(next(ticks))))
    batch.add([1, 2, 3, 4, 5], 40, drafter=ModelDrafter(draft))
    for _ in range(10):
        batch.step()
    timed = [s is not None for s in policy.draft_s]
    assert policy.draft_s[2:6] == ["no draft"] * 4
    assert timed[:2] == [True, True] and timed[6] is False and timed[7:] == [True] * 3


# -- CostK chooses k for a batch ----------------------------------------------------------------


def test_costk_untimed_priors_draft_less_for_larger_batches():
    """With a steep verify slope (arithmetic-bound forwards) large batches pick small k, down to
    0, where one row still drafts."""
    ks = []
    for rows in (1, 2, 4, 8, 16, 64):
        policy = CostK(8, verify_slope=0.05, prior_acceptance=0.8, explore_every=0)
        ks.append(policy.next_batch_k(8, rows))
    assert ks == sorted(ks, reverse=True)
    assert ks[0] >= 2 and ks[-1] == 0
    c1, v1 = CostK(8, explore_every=0).costs(1)
    c8, v8 = CostK(8, explore_every=0).costs(8)
    assert c8 > c1 and all(b > a for a, b in zip(v1, v8, strict=True))
    # a flat slope (memory-bound forwards): the batch drafts as one row does
    flat = CostK(8, verify_slope=0.0, prior_acceptance=0.8, explore_every=0)
    assert flat.next_batch_k(8, 64) == flat.next_k(8) > 0


def _steep_costk() -> CostK:
    """A CostK that measured (synthetic seconds) cheap one-row steps and steeply growing batch
    forwards: T(1) = 1, T(4) = 1.1, T(8) = 8, T(32) = 40; every draft accepted."""
    policy = CostK(8, explore_every=0)
    for _ in range(10):  # one row: k = 0 and k = 3
        policy.observe_step([(0, 0)], None, 1.0, 1)
        policy.observe_step([(3, 3)], 0.3, 1.1, 4)
    for _ in range(10):  # eight rows: k = 0 and k = 3 (arithmetic-bound)
        policy.observe_step([(0, 0)] * 8, None, 8.0, 8)
        policy.observe_step([(3, 3)] * 8, 0.8, 40.0, 32)
    return policy


def test_costk_stops_drafting_a_batch_whose_forward_grows_steeply():
    policy = _steep_costk()
    assert policy.next_k(8) > 0
    assert policy.next_batch_k(8, 8) == 0
    assert policy.next_batch_k(8, 4) == 0  # T(4) = 1.1 but T(8) = 8: k = 1 costs 8
    assert policy.next_batch_k(8, 2) > 0  # T(2 (k + 1)) stays near T(1) for k = 1
    c, v = policy.costs(8)
    assert v[0] == pytest.approx(8.0) and v[3] == pytest.approx(40.0)
    assert c == pytest.approx(0.8 / 3)  # the draft's seconds per depth over T(1)


def test_costk_one_row_observe_is_observe_step():
    a, b = CostK(6, explore_every=3), CostK(6, explore_every=3)
    history = [(3, 1, 0.2, 1.1), (4, 4, 0.3, 1.2), (2, 0, 0.1, 1.0), (5, 2, None, None)]
    for _ in range(3):
        for drafted, accepted, draft_s, target_s in history:
            a.observe(drafted, accepted, draft_s, target_s)
            b.observe_step([(drafted, accepted)], draft_s, target_s, drafted + 1)
            assert a.acceptance() == b.acceptance()
            assert a.costs(1) == b.costs(1) and a.costs(4) == b.costs(4)
            assert a.next_k(6) == b.next_batch_k(6, 1)  # one row of a batch: next_k


def test_a_batch_with_costk_stays_exact_when_it_stops_drafting(llama):
    """With those costs the batch drafts at 2 rows, stops drafting once 4 run, and drafts again
    as rows finish: every row is still its own greedy decode."""
    target, draft = llama
    got = batched(target, RAGGED, ModelDrafter(draft), policy=_steep_costk())
    for job, outcome in zip(RAGGED, got, strict=True):
        assert outcome.tokens == alone(target, job, None).tokens
    assert got[1].stats.k_hist == {1: 2, 0: 3}  # 2 rows for two steps (k = 1), then 4 rows
    # it never ran next to fewer than 2 other rows (its 12 tokens: the prefill's, 11 steps)
    assert got[3].stats.k_hist == {0: 11}
    assert got[0].stats.k_hist[1] > 2  # it drafts again once it is alone


class _AskedToBegin(FixedK):
    """k = 2 every step; `pays_to_begin` answers `pays` and records what it was asked."""

    def __init__(self, pays: bool) -> None:
        super().__init__(2)
        self.pays, self.asked = pays, []

    def pays_to_begin(self, k, rows, remaining, prefill_s):
        self.asked.append((k, rows, remaining, prefill_s))
        return self.pays


@pytest.mark.parametrize("pays", [True, False])
def test_a_row_whose_draft_would_not_pay_decodes_without_it(llama, pays):
    target, draft = llama
    jobs = [Job([1, 2, 3, 4, 5], 12), Job([7, 8], 9)]
    policy = _AskedToBegin(pays)
    got = batched(target, jobs, ModelDrafter(draft), policy=policy, begin_draft=False)
    for job, outcome in zip(jobs, got, strict=True):
        assert outcome.tokens == alone(target, job, None).tokens  # greedy: the target's
        assert outcome.row.drafting == pays and (outcome.stats.drafted > 0) == pays
    # asked for each row in its first step (untimed: no prefill time known); once begun, a
    # row is not asked again, and one not begun is asked again at each step
    assert policy.asked[:2] == [(2, 2, 11, None), (2, 2, 8, None)]
    assert len(policy.asked) == 2 if pays else len(policy.asked) > 2
