"""Look-ahead policies (fixed, heuristic, cost) and confidence stops: still lossless, and each
policy chooses the k its rule says."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdecode import SpeculativeDecoder
from specdecode.core import metrics
from specdecode.core.policies import (
    STALE_STEPS,
    TRUSTED_SAMPLES,
    CostK,
    FixedK,
    HeuristicK,
    KPolicy,
    make_k_policy,
    prior_cost_ratio,
)
from specdecode.core.sampling import SamplingParams
from specdecode.core.types import ForwardMeter
from specdecode.drafters import ModelDrafter, NgramDrafter
from test_sampling_lossless import (
    VOCAB,
    chi_square,
    chi_square_limit,
    exact_step_joint,
    first_step_draws,
)

from conftest import noisy_copy, tiny_llama

PROMPTS = [[1, 2, 3], [5] * 12, [11]]


def _policies() -> dict[str, tuple[str | KPolicy, bool]]:
    """name -> (k_policy for SpeculativeDecoder, time forwards?)."""
    return {
        "fixed": ("fixed", True),
        "heuristic": ("heuristic", True),
        # untimed, with a cheap prior c: it drafts, with k varying (deterministic)
        "cost": (CostK(6, cost_ratio=0.05, explore_every=4), False),
        # timed: decides from measured forward times
        "cost-timed": ("cost", True),
    }


# -- lossless ------------------------------------------------------------------------------------


@pytest.mark.parametrize("confidence", [None, 0.1], ids=["no-confidence", "confidence"])
@pytest.mark.parametrize("policy", sorted(_policies()))
def test_greedy_output_is_the_targets_for_every_policy(policy, confidence):
    target = tiny_llama(seed=0)
    ar = SpeculativeDecoder(target)
    references = {tuple(p): ar.generate(p, max_new_tokens=32).token_ids for p in PROMPTS}
    ks_seen: set[int] = set()
    for draft in (noisy_copy(target, 0.05, seed=1), noisy_copy(target, 0.15, seed=2)):
        for k in (2, 6):
            k_policy, timed = _policies()[policy]
            engine = SpeculativeDecoder(
                target, draft, k=k, k_policy=k_policy, confidence=confidence, time_forwards=timed
            )
            for prompt in PROMPTS:
                result = engine.generate(prompt, max_new_tokens=32)
                stats = result.stats
                assert result.token_ids == references[tuple(prompt)], (policy, k, prompt)
                assert stats.new_tokens == 32
                assert sum(stats.k_hist.values()) == stats.steps
                assert max(stats.k_hist) <= stats.k_max
                assert stats.k_policy == engine.k_policy.name
                ks_seen.update(stats.k_hist)
    if policy != "cost-timed":  # the timed choice depends on this machine's timings
        assert len(ks_seen) >= 3, (
            ks_seen
        )  # the look-ahead really varies (with the clamp at the end)


def test_sampling_stays_lossless_with_a_policy_and_confidence():
    """The joint law of the first step's two tokens is the target's (as in
    test_sampling_lossless) when
    k follows the heuristic schedule and confidence cuts drafts short."""
    params = SamplingParams(temperature=1.0)
    target = tiny_llama(seed=3, vocab=VOCAB, layers=1)
    draft = tiny_llama(seed=4, vocab=VOCAB, layers=1)  # an unrelated draft
    exact = exact_step_joint(target, params)  # [V*V]
    engine = SpeculativeDecoder(
        target, draft, k=2, k_policy="heuristic", confidence=0.35, time_forwards=False
    )
    n = 1500  # about 20 s of CPU; the correct algorithm sits far below the limit
    counts, results = first_step_draws(engine, params, n)
    ks: dict[int, int] = {}
    drafted = asked = 0
    for result in results:
        for k, steps in result.stats.k_hist.items():
            ks[k] = ks.get(k, 0) + steps
            asked += k * steps
        drafted += result.stats.drafted
    assert ks.get(1, 0) > 100 and ks.get(2, 0) > 100  # the heuristic moved k (2 -> 1)
    assert drafted < asked  # confidence cut some drafts short
    limit = chi_square_limit(int((exact > 0).sum()))
    assert chi_square(counts, exact) < limit
    # power: the draft's own distribution is far from the target's at this n
    draft_joint = exact_step_joint(draft, params)
    assert chi_square(draft_joint * n, exact) > 5 * limit


# -- the schedules --------------------------------------------------------------------------------


def test_heuristic_schedule_is_hugging_faces():
    policy = HeuristicK(2, 7)
    policy.begin()
    seen = []
    # (drafted, accepted) after each step: all accepted -> +2 (capped at 7), else -1 (floor 1)
    for drafted, accepted in [(2, 2), (4, 4), (6, 6), (7, 7), (7, 3), (6, 0), (5, 4), (4, 0)]:
        assert policy.next_k(100) == drafted
        policy.observe(drafted, accepted, None, None)
        seen.append(policy.k)
    assert seen == [4, 6, 7, 7, 6, 5, 4, 3]
    for _ in range(5):
        policy.observe(policy.k, 0, None, None)
    assert policy.k == 1  # floor
    policy.observe(0, 0, None, None)  # nothing drafted: no evidence, no change
    assert policy.k == 1
    policy.observe(1, 1, None, None)
    assert policy.next_k(100) == 3 and policy.next_k(2) == 2 and policy.next_k(0) == 0
    policy.begin()  # a new sequence starts again at k0
    assert policy.next_k(100) == 2


def _timed(policy: CostK, alpha_pattern, c: float, v, t1: float = 0.01, rounds: int = 6) -> None:
    """Feed every k = 0..k_max `rounds` times: accepted = alpha_pattern(k), draft time c·t1 per
    drafted token, target time v(k)·t1."""
    for _ in range(rounds):
        for k in range(policy.k_max + 1):
            policy.observe(k, alpha_pattern(k), c * t1 * k, v(k) * t1)


def test_cost_policy_drafts_far_when_drafts_are_cheap_and_right():
    policy = CostK(8, explore_every=0)
    _timed(policy, alpha_pattern=lambda k: k, c=0.02, v=lambda k: 1 + 0.01 * k)
    assert policy.next_k(100) == 8
    assert policy.next_k(5) == 5  # never past what the caller allows
    c, v = policy.costs()
    assert c == pytest.approx(0.02) and v[4] == pytest.approx(1.04)


@pytest.mark.parametrize(
    "alpha_pattern, c",
    [(lambda k: 0, 0.02), (lambda k: min(k, 1), 0.02), (lambda k: k, 1.5)],
    ids=["never-accepted", "only-first-accepted", "expensive-draft"],
)
def test_cost_policy_stops_drafting_when_it_does_not_pay(alpha_pattern, c):
    policy = CostK(8, explore_every=0)
    _timed(policy, alpha_pattern, c=c, v=lambda k: 1 + 0.2 * k)
    assert policy.next_k(100) <= 1


def test_cost_policy_maximises_the_metrics_formula():
    """With acceptance pinned (a huge prior weight) the choice is metrics.ideal_speedup's argmax."""
    for alpha, c, slope in [(0.8, 0.1, 0.0), (0.9, 0.05, 0.1), (0.6, 0.3, 0.02), (0.95, 0.2, 0.0)]:
        policy = CostK(10, prior_acceptance=alpha, prior_weight=1e9, explore_every=0)
        _timed(policy, alpha_pattern=lambda k: 0, c=c, v=lambda k, s=slope: 1 + s * k)
        expected = max(range(11), key=lambda k: metrics.ideal_speedup(alpha, k, c, 1 + slope * k))
        assert policy.next_k(100) == expected, (alpha, c, slope)
        rate = policy.rates()[expected]
        assert rate == pytest.approx(
            metrics.ideal_speedup(alpha, expected, c, 1 + slope * expected)
        )


def test_cost_policy_priors_without_a_clock():
    assert CostK(4, cost_ratio=0.0, verify_slope=0.0).next_k(100) == 4  # free drafts: draft all
    assert CostK(4, cost_ratio=1.0).next_k(100) == 0  # drafts as dear as the target: don't
    policy = CostK(4, cost_ratio=0.05, explore_every=0)
    policy.begin()
    first = policy.next_k(100)
    for _ in range(20):  # untimed steps, nothing accepted
        policy.observe(first, 0, None, None)
    assert first >= 2 and policy.next_k(100) == 0
    policy.begin()  # acceptance is per sequence: back to the prior
    assert policy.next_k(100) == first


def test_cost_policy_interpolates_and_extrapolates_target_time():
    policy = CostK(6, explore_every=0)
    for _ in range(3):
        policy.observe(0, 0, 0.0, 0.010)
        policy.observe(4, 4, 0.004, 0.018)
    _, v = policy.costs()
    assert v[2] == pytest.approx(1.4)  # halfway between v(0) = 1 and v(4) = 1.8
    assert v[6] == pytest.approx(2.2)  # the same slope beyond the last seen k


def test_cost_policy_explores_a_neighbour():
    policy = CostK(4, cost_ratio=1.0, explore_every=3)  # best k is 0 throughout
    chosen = [policy.next_k(100) for _ in range(9)]
    assert chosen == [0, 0, 1, 0, 0, 1, 0, 0, 1]  # k = 0 teaches nothing: explore k = 1
    greedy = CostK(4, cost_ratio=0.0, verify_slope=0.0, explore_every=2)  # best k is 4
    assert [greedy.next_k(100) for _ in range(4)] == [4, 3, 4, 3]


def test_cost_policy_explores_only_a_k_that_could_pay_fully_accepted():
    # measured (TRUSTED_SAMPLES times and more): one row 10 ms, a draft forward 5 ms (c = 0.5);
    # k = 1 rejected every time
    def policy_with(two_rows_s: float) -> CostK:
        policy = CostK(1, explore_every=2)
        for _ in range(TRUSTED_SAMPLES):
            policy.observe(0, 0, None, 0.010)
        for _ in range(4):
            policy.observe(1, 0, 0.005, two_rows_s)
        return policy

    # 2 rows cost 2 one-row forwards (arithmetic-bound): k = 1 emits at most 2 tokens for
    # 0.5 + 2 = 2.5 forwards, below k = 0's 1 for 1 whatever the acceptance: never tried
    bound = policy_with(0.020)
    assert [bound.next_k(100) for _ in range(6)] == [0] * 6
    # 2 rows at 1.1: fully accepted, k = 1 would give 2 for 1.6: worth a step now and then
    cheap = policy_with(0.011)
    assert [cheap.next_k(100) for _ in range(6)] == [0, 1, 0, 1, 0, 1]


def test_a_batch_stops_exploring_a_k_that_cannot_pay_without_one_row_or_every_size_measured():
    # 6 and 8 rows, each measured TRUSTED_SAMPLES times: a k = 1 step costs 2.5 k = 0 steps
    # (arithmetic-bound) plus a draft forward, and its drafts are rejected. Even fully accepted,
    # k = 1 could not pay. The batch never ran one row (T(1), which cancels out of the
    # comparison), and 7 rows were never measured (interpolated between trusted 6 and 8): no
    # exploration step should pay the drafts' prefills and catch-up for nothing.
    policy = CostK(1, explore_every=2)
    for rows, step_s in ((6, 0.030), (8, 0.037)):
        for _ in range(TRUSTED_SAMPLES):
            policy.observe_step([(0, 0)] * rows, None, step_s, rows)
            policy.observe_step([(1, 0)] * rows, 0.030, 2.5 * step_s, 2 * rows)
    for rows in (6, 7, 8):
        assert [policy.next_batch_k(100, rows) for _ in range(8)] == [0] * 8
    # one sample at a size is not trusted: 5 rows (extrapolated) and 4 still explore
    policy.observe_step([(0, 0)] * 4, None, 0.025, 4)
    assert 1 in [policy.next_batch_k(100, 4) for _ in range(4)]
    assert 1 in [policy.next_batch_k(100, 5) for _ in range(4)]


def test_one_slow_forward_does_not_keep_the_cost_policy_from_drafting():
    # one row 10 ms, a draft forward 1 ms (c = 0.1), 2-4 rows barely more, every draft accepted:
    # k = 3 pays. But the first 2-row forward took 200 ms (a hiccup): judged on that one sample,
    # k = 1 could never pay, and a policy that only explores a k that could would stay at 0
    # (it did: 40 steps of k = 0 before TRUSTED_SAMPLES and the median).
    policy = CostK(3, explore_every=2)
    policy.observe(0, 0, None, 0.010)
    policy.observe(1, 1, 0.001, 0.200)
    chosen = []
    for _ in range(40):
        k = policy.next_k(100)
        chosen.append(k)
        policy.observe(k, k, 0.001 * k if k else None, 0.010 + 0.0005 * k)
    assert 1 in chosen[:6]  # one slow sample is not trusted to rule k = 1 out
    assert chosen[-10:].count(3) >= 5  # the median forgets the hiccup: back to drafting 3
    assert 0.200 in policy._target[2].samples and policy._target_time(2) < 0.011


def test_costs_measured_slow_once_do_not_keep_the_cost_policy_at_k0_for_good():
    # The draft's first forwards were slow (c = 1.5, TRUSTED_SAMPLES times: a warm-up), so
    # k = 1 could not pay even fully accepted, k = 0 ran, and nothing measured the draft again:
    # a bench run stayed at k = 0 for all its prompts while drafting 3 paid. Times STALE_STEPS
    # steps old no longer rule a k out: it is tried, measured afresh, and drafting resumes.
    policy = CostK(3, explore_every=8)
    for _ in range(TRUSTED_SAMPLES):
        policy.observe(0, 0, None, 0.010)
        policy.observe(1, 1, 0.015, 0.0105)
    chosen = []
    for _ in range(STALE_STEPS + 100):
        k = policy.next_k(100)
        chosen.append(k)
        policy.observe(k, k, 0.001 * k if k else None, 0.010 + 0.0005 * k)
    assert set(chosen[: STALE_STEPS - 16]) == {0}  # the slow times stand while they are recent
    assert chosen[-50:].count(3) >= 40  # measured again: c = 0.1, and every draft accepted
    assert policy._draft[1].samples[0] == pytest.approx(0.001)  # the old times were dropped


def test_the_cost_policy_judges_sizes_measured_before_and_after_the_machine_slowed_alike():
    # A server's policy learns one row (k = 0..3: 1-4 rows verified), then, minutes later, two
    # rows drafting 3 most steps (8 rows verified, 2-6 now and then); meanwhile the VM's load
    # made every forward 1.5x slower. Sizes 2 and 4 keep their many fast samples, 6 and 8 have
    # slow ones only: compared as measured, k = 1 looks cheap beside k = 3, and the policy
    # drafted less than it should (in one process: k = 1 at 134 of 816 two-row steps, below
    # fixed k = 3). Judged through the machine's speed, costs and choice are those of a
    # machine that never slowed.
    def shape(n: int) -> float:  # seconds of a forward over n rows at the first speed
        return 0.010 * (1 + 0.02 * (n - 1))

    def learn(slower: float) -> CostK:
        policy = CostK(3, prior_acceptance=0.7, prior_weight=1e9, explore_every=0)
        for _ in range(12):
            for k in range(4):
                policy.observe_step([(k, k)], 0.001 * k or None, shape(k + 1), k + 1)
        for _ in range(4):
            for k in (0, 1, 2, 3, 3, 3):
                times = (slower * 0.0015 * k or None, slower * shape(2 * (k + 1)))
                policy.observe_step([(k, k)] * 2, *times, 2 * (k + 1))
        return policy

    steady, drifted = learn(1.0), learn(1.5)
    c, v = steady.costs(2)
    assert drifted.costs(2) == (pytest.approx(c, rel=0.01), pytest.approx(v, rel=0.01))
    assert drifted.next_batch_k(100, 2) == steady.next_batch_k(100, 2) == 3


def test_make_k_policy_and_bad_names():
    assert isinstance(make_k_policy("fixed", 3), FixedK)
    heuristic = make_k_policy("heuristic", 3)
    assert isinstance(heuristic, HeuristicK) and (heuristic.k0, heuristic.k_max) == (3, 6)
    cost = make_k_policy("cost", 5, cost_ratio=0.3)
    assert isinstance(cost, CostK) and cost.k_max == 5 and cost.cost_ratio == 0.3
    for policy in (FixedK(2), heuristic, cost):
        assert isinstance(policy, KPolicy)
    with pytest.raises(ValueError, match="fixed, heuristic, cost"):
        make_k_policy("adaptive", 4)
    target = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="fixed, heuristic, cost"):
        SpeculativeDecoder(target, target, k_policy="nope")


# -- confidence ----------------------------------------------------------------------------------


def _drafter(model, confidence):
    drafter = ModelDrafter(model, confidence=confidence)
    drafter.begin([1, 2, 3], SamplingParams(), None, ForwardMeter())
    return drafter


def test_confidence_truncates_drafts_and_keeps_the_cache_exact():
    model = tiny_llama(seed=0)  # top probabilities of this random model: about 0.07-0.15
    context = [1, 2, 3]
    full = _drafter(model, None).propose(context, 8).tokens
    assert len(_drafter(model, 0.01).propose(context, 8)) == 8
    sure = _drafter(model, 0.99)
    assert sure.propose(context, 8).tokens.tolist() == full[:1].tolist()  # at least one token
    assert len(sure.cache) == len(context) + 1  # the forward that judged d_2 was fed d_1
    lengths = []
    for threshold in (0.06, 0.08, 0.1, 0.12):
        drafter = _drafter(model, threshold)
        draft = drafter.propose(context, 8)
        assert draft.tokens.tolist() == full[: len(draft)].tolist()  # a prefix of the full draft
        lengths.append(len(draft))
        if len(draft) < 8:
            assert len(drafter.cache) == len(context) + len(draft)
            drafter.observe(len(draft))  # all accepted: nothing to roll back, no catch-up needed
            assert len(drafter.cache) == len(context) + len(draft)
    assert lengths == sorted(lengths, reverse=True) and 1 < lengths[1] < 8, lengths


def test_confidence_through_the_engine():
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.05, seed=1)
    plain = SpeculativeDecoder(target, draft, k=6, k_policy="fixed").generate([1, 2, 3], 32)
    cut = SpeculativeDecoder(target, draft, k=6, confidence=0.1, k_policy="fixed").generate(
        [1, 2, 3], 32
    )
    assert cut.token_ids == plain.token_ids
    assert cut.stats.drafted < plain.stats.drafted
    assert cut.stats.acceptance_rate > plain.stats.acceptance_rate  # the unsure drafts were cut
    for bad in (0.0, 1.0, 2, "high"):
        with pytest.raises(ValueError, match="confidence"):
            SpeculativeDecoder(target, draft, confidence=bad)
    with pytest.raises(ValueError, match="model draft"):
        SpeculativeDecoder(target, NgramDrafter(), confidence=0.5)
    with pytest.raises(ValueError, match="model draft"):
        SpeculativeDecoder(target, None, confidence=0.5)


def test_stats_name_the_policy_and_count_ks():
    target = tiny_llama(seed=0)
    stats = SpeculativeDecoder(target, target, k=2, k_policy="heuristic").generate([1], 21).stats
    out = stats.to_dict()
    assert out["k_policy"] == "heuristic" and out["k_max"] == 4
    # identical draft: the prefill's token (no step), then k = 2, then +2 up to the cap
    # (k_max = 4), then 1 to stop at exactly 21 tokens
    assert out["k_hist"] == {1: 1, 2: 1, 4: 3}
    ar = SpeculativeDecoder(target).generate([1], 5).stats.to_dict()
    assert ar["k_policy"] == "" and ar["k_hist"] == {0: 4}  # the 1st token is the prefill's


def test_the_cost_prior_asks_the_drafter_not_its_type():
    target = tiny_llama(seed=0)
    assert prior_cost_ratio(target, NgramDrafter()) == 0.0  # no model: drafting costs nothing
    assert prior_cost_ratio(target, SimpleNamespace(cost_ratio=0.25)) == 0.25
    # the protocol's default (BaseDrafter.cost_ratio None): no model, no stated c
    assert prior_cost_ratio(target, SimpleNamespace(cost_ratio=None)) is None
    same = prior_cost_ratio(target, ModelDrafter(target))  # parameter counts: the same model
    assert same == pytest.approx(1.0)


def test_the_cost_policy_says_when_it_explores_and_whether_it_knows_acceptance():
    policy = CostK(4, explore_every=2)
    flags = []
    for _ in range(6):
        policy.next_batch_k(4, 2)
        flags.append(policy.exploring)
    assert flags == [False, True] * 3  # nothing timed yet: every neighbour is worth a try
    assert not policy.knows_acceptance and policy.begins_drafts()  # nothing learnt: it may
    policy.observe_step([(2, 1), (2, 2)], None, None, 6)
    assert policy.knows_acceptance and not policy.begins_drafts()  # the last step explored
    policy.next_batch_k(4, 2)
    assert not policy.exploring and policy.begins_drafts()
    policy.begin()  # a new sequence: acceptance is the prompt's
    assert not policy.knows_acceptance


def test_a_draft_is_begun_only_where_its_prefill_pays_for_itself():
    policy = CostK(4, explore_every=0)
    assert policy.pays_to_begin(2, 8, 10, 5.0)  # nothing measured: a first estimate is learnt
    _timed(policy, alpha_pattern=lambda k: k, c=0.1, v=lambda k: 1 + 0.1 * k, t1=0.01)
    rates = policy.rates(4)
    per_token = 0.01 * (1 / rates[0] - 1 / rates[4])  # seconds drafting k = 4 saves a token
    assert per_token > 0
    assert policy.pays_to_begin(4, 1, 100, 0.9 * 100 * per_token)
    assert not policy.pays_to_begin(4, 1, 100, 1.1 * 100 * per_token)
    assert not policy.pays_to_begin(4, 1, 10, 0.9 * 100 * per_token)  # a short answer
    assert policy.pays_to_begin(4, 1, 10, None)  # a prefill not timed yet
    assert policy.pays_to_begin(0, 1, 10, 1.0)  # nothing to begin for
    policy.begin()  # a new sequence: acceptance unknown again, so its draft may begin
    assert policy.pays_to_begin(4, 1, 10, 1.0)
    # a batch whose k barely beats 0 saves nothing worth a prefill
    flat = CostK(2, explore_every=0)
    _timed(flat, alpha_pattern=lambda k: 0, c=0.5, v=lambda k: 1 + 0.5 * k, t1=0.01)
    assert not flat.pays_to_begin(1, 8, 1000, 0.001)
