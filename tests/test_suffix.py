"""Suffix drafting and the hybrid: the trees they draft, losslessness, the pool across requests,
and their place in the engine (drafters/suffix.py, drafters/hybrid.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core import batch as batch_module
from specdecode.core.draft_spec import DraftSpec, SuffixOptions
from specdecode.core.policies import CostK, FixedK, size_trees, verify_cost
from specdecode.core.sampling import SamplingParams
from specdecode.core.types import ForwardMeter
from specdecode.drafters import (
    HybridDrafter,
    SuffixDrafter,
    SuffixPool,
    hybrid_drafter,
    resolve_draft,
)
from specdecode.models.loading import wrap_model

from conftest import ARCHS, tiny_llama


def _suggest(context, max_depth=16, pool_outputs=(), rho=None, **options):
    """The drafter's proposal after `context`; `rho`: its calibration's prior (1: the votes'
    shares as they are)."""
    drafter = SuffixDrafter(SuffixOptions(**options))
    if rho is not None:
        drafter.calibration.prior = rho
    for output in pool_outputs:
        drafter.pool.add(output)
    drafter.begin(list(context), SamplingParams(), None, ForwardMeter())
    return drafter.suggest(list(context), max_depth)


def _tree_paths(proposal, n):
    """Each node's root-to-node tokens, for the first n nodes."""
    paths = []
    for token, parent in zip(proposal.tokens[:n], proposal.parents[:n], strict=True):
        paths.append((*paths[parent], token) if parent >= 0 else (token,))
    return paths


def test_votes_of_every_occurrence_shape_the_tree():
    # [1, 2] occurred three times after an 8: followed by 3 4, 3 5 and 3 4
    context = [8, 1, 2, 3, 4, 8, 1, 2, 3, 5, 8, 1, 2, 3, 4, 7, 1, 2]
    proposal = _suggest(context, rho=1.0)
    assert proposal.length == 2  # [7, 1, 2] never occurred before
    paths = _tree_paths(proposal, len(proposal.tokens))
    assert paths[:2] == [(3,), (3, 4)]
    assert proposal.gains[:2] == [1.0, pytest.approx(2 / 3)]  # shares of the votes
    assert (3, 5) in paths
    # parents always come first, and every prefix of the order is a tree
    for i, parent in enumerate(proposal.parents):
        assert parent < i
    assert proposal.gains == sorted(proposal.gains, reverse=True)
    # the longest match alone votes: [8, 1, 2] after another 8 matches one occurrence more deeply
    longer = _suggest([*context[:-3], 3, 5, 8, 1, 2], rho=1.0)
    assert longer.length == 5 and _tree_paths(longer, 2) == [(3,), (3, 4)]
    assert longer.gains[:2] == [1.0, 1.0]
    # before any tree is verified, a drafted token is believed with the prior rho per level
    assert _suggest(context).gains[:2] == [pytest.approx(0.6), pytest.approx(2 / 3 * 0.36)]


def test_no_match_drafts_nothing_and_short_matches_draft_small_trees():
    assert _suggest([1, 2, 3, 4, 5]).tokens == []
    assert _suggest([7]).tokens == []
    # a 2-token match with factor 1 keeps at most 2 nodes
    context = [5, 6, 1, 2, 3, 4, 7, 8, 9, 1, 2]
    assert len(_suggest(context, factor=1.0).tokens) <= 2
    assert len(_suggest(context, factor=8.0).tokens) > 2
    # depth bounds the deepest level; max_depth (what the row may still emit) too
    long = [*range(10, 40), 10, 11]
    shallow = _suggest(long, depth=5)
    assert max(len(p) for p in _tree_paths(shallow, len(shallow.tokens))) == 5
    assert len(_suggest(long, max_depth=3).tokens) == 3


def test_min_prob_drops_rare_branches():
    # ten occurrences of [1, 2] followed by 3, one followed by 4
    context = [1, 2, 3, 0] * 10 + [1, 2, 4, 0] + [1, 2]
    every = _suggest(context, min_prob=0.0, nodes=64, factor=100.0)
    assert (4,) in _tree_paths(every, len(every.tokens))
    pruned = _suggest(context, min_prob=0.2, nodes=64, factor=100.0)
    assert (4,) not in _tree_paths(pruned, len(pruned.tokens))


def test_the_tree_is_sized_by_its_verification_cost():
    # ten occurrences: the first 4 levels have 9 votes in 10, the next 4 have 8, then 7
    context = [1, 2, 3, 0] * 10 + [1, 2, 4, 0] + [1, 2]
    proposal = _suggest(context, rho=1.0)
    assert proposal.gains[3:5] == [pytest.approx(0.9), pytest.approx(0.8)]
    cheap, _ = proposal.best_size(None)  # the prior: v grows 5% a row
    assert cheap == len(proposal.tokens) == 12
    # v grows 0.85 a row: a node pays while its acceptance beats 0.85 x the tokens so far
    steep, rate = proposal.best_size(CostK(4, verify_slope=0.85))
    assert steep == 4 and rate == pytest.approx((1 + 4 * 0.9) / (1 + 4 * 0.85))
    assert proposal.best_size(CostK(4, verify_slope=1.5))[0] == 0  # no tree pays


def test_a_batch_sizes_its_trees_together_against_its_whole_forward():
    # T(rows): 10 ms for 1, 11 for 2, 20 for 8, 30 for 9: a row's second verified token is
    # cheap alone, a ninth row in a batch of 8 is dear
    policy = CostK(4)
    for rows, seconds in ((1, 0.010), (2, 0.011), (8, 0.020), (9, 0.030)):
        policy.observe_step([(0, 0)], None, seconds, rows)
    assert size_trees([[0.6]], 1, 1.0, policy)[0] == [1]  # alone: 1.6 / 1.1 > 1 / 1
    assert size_trees([[0.6]] + [[]] * 7, 8, 8.0, policy)[0] == [0] * 8  # 8.6 / 3 < 8 / 2
    # the likeliest nodes of any tree first, each tree keeping a prefix of its order
    counts, rate = size_trees([[0.9, 0.2], [0.7, 0.6]], 2, 2.0, None)  # v: 5% a row
    assert counts == [2, 2] and rate == pytest.approx(4.4 / 1.25)
    steep = CostK(4, verify_slope=0.25)  # 4.2 tokens / v(5) = 2.1, then 4.4 / v(6) = 1.96
    assert size_trees([[0.9, 0.2], [0.7, 0.6]], 2, 2.0, steep)[0] == [1, 2]
    # one tree alone on one row: the suffix drafter's own sizing
    proposal = _suggest([1, 2, 3, 0] * 10 + [1, 2, 4, 0] + [1, 2], rho=1.0)
    for costs in (None, CostK(4, verify_slope=0.85)):
        n, rate = proposal.best_size(costs)
        assert size_trees([proposal.gains], 1, 1.0, costs) == ([n], rate)


def test_in_a_batch_suffix_rows_draft_only_what_pays_beside_the_other_rows():
    target = wrap_model(tiny_llama(seed=0, layers=4))
    ar = SpeculativeDecoder(target)
    engine = SpeculativeDecoder(target, SuffixDrafter(SuffixOptions(pool=False)))
    sized = []
    size = batch_module.size_trees

    def spy(gains, rows, tokens, policy):  # what each step's sizing saw and chose
        counts, rate = size(gains, rows, tokens, policy)
        sized.append((len(gains), rows, counts))
        return counts, rate

    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9] * 5, list(range(40, 60)) * 2]
    batch_module.size_trees = spy
    try:
        batch = engine.generate_batch(prompts, max_new_tokens=30)
    finally:
        batch_module.size_trees = size
    assert [r.token_ids for r in batch] == [
        ar.generate(p, max_new_tokens=30).token_ids for p in prompts
    ]
    assert any(trees == 3 and rows == 3 for trees, rows, _ in sized)  # all rows sized at once
    assert any(sum(counts) > 0 for _, _, counts in sized)


def test_rho_learns_what_the_target_keeps_per_match_length():
    drafter = SuffixDrafter()
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [1, 2]
    drafter.begin(context, SamplingParams(), None, ForwardMeter())
    before = drafter.suggest(context, 16)
    for _ in range(20):  # the target keeps one token of each chain, then disagrees
        drafter.take(before, len(before.tokens))
        drafter.observe_path([0])
    after = drafter.suggest(context, 16)
    assert drafter.calibration.rho(before.length) < 0.6 < before.gains[0] / 0.6 + 0.01
    assert after.gains[0] < before.gains[0] and after.best_size(None)[0] < before.best_size(None)[0]
    assert drafter.calibration.rho(2) == 0.6  # another match length learnt nothing
    for _ in range(400):  # a walk that reaches the leaf fails nowhere; old evidence fades
        drafter.take(after, 1)
        drafter.observe_path([0])
    assert drafter.calibration.rho(after.length) > 0.9


def test_each_row_learns_its_own_rho_from_the_shared_one():
    import copy

    shared = SuffixDrafter()
    context = [1, 2, 3, 4, 5, 6, 7, 8] * 4 + [1, 2]
    follows, breaks = copy.copy(shared), copy.copy(shared)  # two rows of one batch
    for row in (follows, breaks):
        row.begin(list(context), SamplingParams(), None, ForwardMeter())
    proposal = follows.suggest(context, 4)
    for _ in range(6):  # one row's target keeps whole chains, the other's none of them
        follows.take(proposal, len(proposal.tokens))
        follows.observe_path(list(range(len(proposal.tokens))))
        breaks.take(proposal, len(proposal.tokens))
        breaks.observe_path([])
    length = proposal.length
    assert breaks.rho(length) < shared.calibration.rho(length) < follows.rho(length)
    assert breaks.suggest(context, 4).gains[0] < follows.suggest(context, 4).gains[0]
    # a row begun afresh starts from what every row taught (its prior), not from either row's
    fresh = copy.copy(shared)
    fresh.begin(list(context), SamplingParams(), None, ForwardMeter())
    assert fresh.rho(length) == shared.calibration.rho(length)


def test_verify_cost_is_measured_where_the_policy_is_timed():
    policy = CostK(4)
    assert verify_cost(policy, 1) == 1.0
    assert verify_cost(FixedK(4), 11) == pytest.approx(1.5)  # the prior
    for _ in range(3):
        policy.observe_step([(0, 0)], None, 0.010, 1)
        policy.observe_step([(15, 3)], 0.0, 0.030, 16)
    assert policy.verify_cost(16) == pytest.approx(3.0)
    assert policy.verify_cost(1) == 1.0
    assert policy.draft_cost(0.005) == pytest.approx(0.5)
    assert policy.draft_cost(None) == policy.cost_ratio


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_suffix_drafting_is_lossless_greedy(arch):
    target = wrap_model(ARCHS[arch](seed=0))
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9] * 5, [30], list(range(40, 60)) * 2, [30]]
    ar = SpeculativeDecoder(target)
    engine = SpeculativeDecoder(target, SuffixDrafter(), k_policy="fixed")
    accepted = 0
    for prompt in prompts:
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == ar.generate(prompt, max_new_tokens=40).token_ids
        accepted += result.stats.accepted
    assert accepted > 0  # the random models loop, so lookups hit
    # the batch: every row drafts its own tree (or none), outputs as alone
    batch = engine.generate_batch(prompts, max_new_tokens=40)
    assert [r.token_ids for r in batch] == [
        ar.generate(p, max_new_tokens=40).token_ids for p in prompts
    ]


def test_the_pool_carries_earlier_outputs_to_later_requests():
    target = wrap_model(tiny_llama(seed=0, layers=4))
    engine = SpeculativeDecoder(target, SuffixDrafter(), k_policy="fixed")
    alone = SpeculativeDecoder(target, SuffixDrafter(SuffixOptions(pool=False)), k_policy="fixed")
    prompt = [30]  # nothing to look up in the prompt
    first = engine.generate(prompt, max_new_tokens=40)
    again = engine.generate(prompt, max_new_tokens=40)
    assert again.token_ids == first.token_ids
    assert again.stats.accepted > first.stats.accepted + 20  # the first output, drafted again
    assert again.stats.steps < first.stats.steps / 3
    report = engine.drafter.pool.report()
    assert report["outputs"] == 2 and report["tokens"] == 80 and report["bytes"] > 0
    # pool=off: each request alone
    assert alone.generate(prompt, max_new_tokens=40).stats.accepted == first.stats.accepted
    assert alone.generate(prompt, max_new_tokens=40).stats.accepted == first.stats.accepted
    assert alone.drafter.pool is None


def test_the_pool_is_bounded_and_evicts_the_oldest():
    pool = SuffixPool(max_tokens=100)
    for i in range(10):
        pool.add([i] * 30)
    report = pool.report()
    assert report["tokens"] <= 100 and report["outputs"] == 3 and report["evicted"] == 7
    assert [m.text.ids[0] for m in pool.matches([9, 9], 64)][:1] == [9]
    assert pool.matches([0, 0], 64) == []  # evicted
    big = SuffixPool(max_tokens=10)
    big.add(list(range(50)))  # longer than the pool: its last 10 tokens
    assert big.report()["tokens"] == 10
    SuffixPool(0).add([1, 2, 3])  # a pool of nothing stays empty


def test_a_corrupted_pool_never_breaks_a_request():
    target = wrap_model(tiny_llama(seed=0))
    engine = SpeculativeDecoder(target, SuffixDrafter(), k_policy="fixed")
    expected = SpeculativeDecoder(target).generate([30], max_new_tokens=20).token_ids
    engine.generate([30], max_new_tokens=20)
    engine.drafter.pool._texts.append("not a text")  # what a bug or a stray write might leave
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.generate([30], max_new_tokens=20).token_ids == expected
    assert any("suffix pool failed" in str(w.message) for w in caught)
    report = engine.drafter.pool.report()
    assert report["faults"] == 1
    assert engine.generate([30], max_new_tokens=20).token_ids == expected  # and it goes on


def _hybrid(target, **options):
    draft = tiny_llama(seed=0, layers=1)
    return hybrid_drafter(draft, target, SuffixOptions(**options))


@pytest.mark.parametrize("policy", ["fixed", "cost"])
def test_the_hybrid_is_lossless_greedy_and_uses_both_parts(policy):
    target = wrap_model(tiny_llama(seed=0, layers=4))
    ar = SpeculativeDecoder(target)
    hybrid = _hybrid(target)
    engine = SpeculativeDecoder(target, hybrid, k=3, k_policy=policy)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [30], list(range(40, 60)) * 2, [30], [5, 6]]
    for prompt in prompts:
        assert (
            engine.generate(prompt, max_new_tokens=40).token_ids
            == ar.generate(prompt, max_new_tokens=40).token_ids
        )
    assert hybrid.chosen["suffix"] > 0 and hybrid.chosen["model"] > 0
    batch = engine.generate_batch(prompts, max_new_tokens=30)  # rows choose on their own
    assert [r.token_ids for r in batch] == [
        ar.generate(p, max_new_tokens=30).token_ids for p in prompts
    ]


def test_a_batchs_hybrid_rows_draft_their_model_chains_together(monkeypatch):
    # rows that choose the model draft in one forward of it per depth, as model-draft rows do:
    # one row's drafting cost for the batch, the same tokens as each row alone
    from specdecode.drafters import ModelDrafter

    target = wrap_model(tiny_llama(seed=0, layers=4))
    ar = SpeculativeDecoder(target)
    hybrid = _hybrid(target)
    engine = SpeculativeDecoder(target, hybrid, k=3, k_policy="fixed")
    together = []
    original = ModelDrafter.propose_many.__func__

    def spy(cls, drafters, contexts, ks):
        together.append(len(drafters))
        return original(cls, drafters, contexts, ks)

    monkeypatch.setattr(ModelDrafter, "propose_many", classmethod(spy))
    prompts = [list(range(40 + 9 * i, 49 + 9 * i)) for i in range(4)]  # nothing repeats
    batch = engine.generate_batch(prompts, max_new_tokens=12)
    assert [r.token_ids for r in batch] == [
        ar.generate(p, max_new_tokens=12).token_ids for p in prompts
    ]
    assert max(together) == 4  # every row's chain in one call
    assert sum(together) == hybrid.chosen["model"]  # and no chain drafted alone besides


def test_a_batch_prices_the_hybrids_rows_against_its_larger_forward():
    # a target whose forward costs the same up to 8 rows, then grows with them (arithmetic-
    # bound): alone, a chain's extra verified rows are free; in a batch of 8 they double the
    # forward, and the share of a cheap draft does not buy them back
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    policy = CostK(4)
    for n in range(1, 41):
        for _ in range(3):
            policy.observe_step([(0, 0)], None, 0.010 * max(1.0, n / 8), n)
    hybrid.share_costs(policy)
    hybrid.begin([1, 2, 3], SamplingParams(), None, ForwardMeter())
    for _ in range(8):  # a model whose chains of 4 are kept 9 times in 10
        hybrid._used = ("model", 4)
        hybrid.observe_path([0, 1, 2, 3] if _ else [0, 1, 2])
    hybrid.draft_seconds.extend([0.001] * 4)  # c = 0.1
    alone, batch = hybrid.model_rate(4), hybrid.model_rate(4, rows=8)
    assert alone[0] == 4 and alone[1] > 1.0  # beats a plain step's 1 token per T(1)
    plain_in_batch = 8 / verify_cost(policy, 8)
    assert batch[1] < plain_in_batch  # 8 rows of one token each beat drafting there
    assert hybrid.model_rate(4, rows=1) == alone


def test_a_deferred_hybrid_begins_its_model_where_its_prefill_pays():
    # measured: a one-row target forward of 10 ms, chains mostly kept, and a draft prefill of
    # 0.1 s a position: a row with 3 tokens left does not pay for its model's prefill and
    # drafts suffix trees or nothing; a row with a long answer ahead begins it
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    policy = CostK(4)
    for _ in range(3):
        policy.observe_step([(0, 0)], None, 0.010, 1)
        policy.observe_step([(4, 3)], 0.004, 0.011, 5)
    hybrid.share_costs(policy)
    meter = ForwardMeter(clock=lambda: 0.0)
    meter.add("draft_prefill", 10, 1.0)
    context = list(range(40, 70))
    hybrid.defer_prefill()  # begun at its row's first drafting step, as a server's rows are
    hybrid.begin(list(context), SamplingParams(), None, meter)
    assert not hybrid._model_ready and hybrid.drafter.cache is None
    for _ in range(3):
        hybrid.propose_tree(context, 2)
        hybrid.observe_path([])
    assert hybrid.chosen["model"] == 0 and hybrid.drafter.cache is None
    hybrid.propose_tree(context, 10_000)  # 10,000 tokens ahead: worth 29 positions' prefill
    assert hybrid._model_ready and len(hybrid.drafter.cache) >= len(context) - 1
    hybrid.observe_path([])
    # a cache handed on level with the prompt (a server's prefill in parts) begins at once
    row = copy.copy(hybrid)
    alone = _chain_drafter()
    alone.begin(list(context), SamplingParams(), None, ForwardMeter())
    row.drafter.prefilled, alone.cache = alone.cache, None
    row.defer_prefill()
    row.begin(list(context), SamplingParams(), None, meter)
    assert row._model_ready
    # begun with its row's prefill (one sequence, `Batch.add`), the model begins at once
    eager = copy.copy(hybrid)
    eager.begin(list(context), SamplingParams(), None, meter)
    assert eager._model_ready and len(eager.drafter.cache) == len(context) - 1


def test_a_batch_defers_a_hybrids_model_only_for_rows_begun_at_their_first_step(monkeypatch):
    from specdecode.core.batch import Batch, fork_drafter

    model = tiny_llama(seed=0, layers=4)
    hybrid = _hybrid(wrap_model(model))
    deferred = []
    monkeypatch.setattr(HybridDrafter, "defer_prefill", lambda self: deferred.append(self))
    batch = Batch(model, policy=CostK(4))
    eager = batch.add(list(range(40, 60)), 8, drafter=fork_drafter(hybrid))
    later = batch.add(list(range(60, 80)), 8, drafter=fork_drafter(hybrid), begin_draft=False)
    assert eager.drafter._model_ready and not later.drafting
    batch.step()
    assert later.drafting and deferred == [later.drafter]


def test_the_hybrid_learns_each_rows_acceptance_from_the_pairs():
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    hybrid.begin([1, 2, 3], SamplingParams(), None, ForwardMeter())
    for _ in range(20):  # one prompt where the model's chains are always kept
        hybrid._used = ("model", 4)
        hybrid.observe_path([0, 1, 2, 3])
    fresh = copy.copy(hybrid)  # the next row starts from the pair's estimate
    fresh.begin([4, 5, 6], SamplingParams(), None, ForwardMeter())
    assert fresh.row_acceptance.estimate(fresh.row_prior)[0] > 0.9
    for _ in range(6):  # a prompt where the model's first token is always wrong
        fresh._used = ("model", 4)
        fresh.observe_path([])
    assert fresh.row_acceptance.estimate(fresh.row_prior)[0] < 0.3
    assert fresh.acceptance.estimate()[0] > 0.6  # the pair's moves slowly, over every row
    assert fresh.model_rate(4)[1] < hybrid.model_rate(4)[1]


def test_a_row_that_keeps_every_chain_comes_to_draft_a_longer_one():
    # the pair learnt (on an earlier row) that a 4th token is seldom kept; on this row every
    # chain of 3 is kept: its 4th position inherits the 3rd's estimate, not the pair's, so the
    # model's best chain grows to 4 (a position never drafted would otherwise never be measured)
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    hybrid.share_costs(CostK(4))
    hybrid.begin([1, 2, 3], SamplingParams(), None, ForwardMeter())
    for _ in range(20):
        hybrid._used = ("model", 4)
        hybrid.observe_path([0, 1, 2])  # the 4th rejected
    row = copy.copy(hybrid)
    row.begin([4, 5, 6], SamplingParams(), None, ForwardMeter())
    assert row.acceptance.estimate()[3] < 0.2
    for _ in range(6):
        row._used = ("model", 3)
        row.observe_path([0, 1, 2])
    estimate = row.row_estimate()
    assert estimate[2] > 0.9 and estimate[3] == pytest.approx(estimate[2])
    assert row.model_rate(4)[0] == 4


def test_every_eighth_model_chain_of_a_row_is_one_token_longer():
    # a deeper position measured now and then (EXPLORE_DEEPER), as the cost policy explores a
    # neighbouring k: a row held at a short chain by one early rejection can still grow out
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    hybrid.share_costs(CostK(4))
    context = list(range(40, 50))  # nothing repeats: no suffix tree
    hybrid.begin(list(context), SamplingParams(), None, ForwardMeter())
    drafted = []
    for step in range(16):
        best = hybrid.model_rate(4)[0]
        tree = hybrid.propose_tree(context, 4)
        drafted.append((best, int(tree.tokens.shape[0])))
        hybrid.observe_path([0])  # the first token kept, the second (where drafted) not
        context += [60 + step, 61 + step]
    assert hybrid.chosen["model"] == 16
    for i, (best, n) in enumerate(drafted):
        assert n == (min(best + 1, 4) if i in (7, 15) else best), drafted


def test_the_hybrid_tries_the_model_again_on_a_row_that_rejected_it():
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    hybrid.prior_cost = 0.9  # a model that barely pays: under a plain step at the prior's rate
    context = list(range(40, 50))  # nothing repeats: no suffix tree
    hybrid.begin(list(context), SamplingParams(), None, ForwardMeter())
    for step in range(24):
        hybrid.propose_tree(context, 4)
        hybrid.observe_path([])  # every chain rejected at its first token
        context.append(60 + step)
    # unsure of the model on this row, it tries it every EXPLORE_UNSURE (8) steps, not 64
    assert hybrid.chosen["model"] == 3 and hybrid.row_acceptance.n[0] == 3


def test_the_hybrid_model_chain_sits_out_and_catches_up():
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    hybrid.begin([1, 2, 3], SamplingParams(), None, ForwardMeter())
    context = [1, 2, 3]
    first = hybrid._model_tree(context, 2)
    hybrid._used = ("model", 2)
    hybrid.observe_path([])  # nothing accepted
    context += [4, 5, 6, 7]  # four steps the suffix drafted
    later = hybrid._model_tree(context, 2)
    assert len(hybrid.drafter.cache) == len(context) + 1  # caught up, one drafted token held
    alone = _chain_drafter()
    alone.begin(list(context), SamplingParams(), None, ForwardMeter())
    assert later.tokens.tolist() == alone.propose(context, 2).tokens.tolist()
    assert first.parents.tolist() == [-1, 0]


def test_the_hybrid_times_the_model_by_its_chains_not_by_one_forward_or_a_catch_up():
    target = wrap_model(tiny_llama(seed=0, layers=4))
    hybrid = _hybrid(target)
    policy = CostK(4)
    policy.observe_step([(0, 0)], None, 0.010, 1)  # the target's single-row forward
    hybrid.share_costs(policy)
    clock = iter(range(10**6))  # each reading one second after the one before
    meter = ForwardMeter(clock=lambda: float(next(clock)))
    hybrid.begin([1, 2, 3], SamplingParams(), None, meter)
    context = [1, 2, 3]

    def chain(committed: list[int]) -> None:  # a model step after `committed` joined the text
        context.extend(committed)
        hybrid._model_tree(context, 2)
        hybrid.observe_path([])  # its first token rejected

    chain([])  # one chain timed (very slow, 1 s a forward): not trusted alone
    assert len(hybrid.draft_seconds) == 1 and hybrid._draft_cost() == hybrid.prior_cost
    chain([4, 5, 6, 7])  # after the suffix's steps: its first forward catches up on them
    assert len(hybrid.draft_seconds) == 1  # the catch-up is not a depth's time
    chain([8])
    chain([9])
    assert list(hybrid.draft_seconds) == [1.0, 1.0, 1.0]
    assert hybrid._draft_cost() == pytest.approx(100.0)  # 1 s against the target's 10 ms


def _chain_drafter():
    """A fresh chain drafter over the draft model `_hybrid` builds."""
    from specdecode.drafters import ModelDrafter

    draft = tiny_llama(seed=0, layers=1)
    return ModelDrafter(draft, vocab_size=draft.config.vocab_size)


def test_suffix_and_hybrid_sampling_keep_the_target_distribution():
    """Deterministic suffix trees and the hybrid's model chains: the first two tokens' joint
    law is the target's (the first step really drafts: the prompt holds 1 followed by every
    id, and the first token follows a 1)."""
    from test_sampling_lossless import chi_square, chi_square_limit

    vocab = 6
    target_model = tiny_llama(seed=3, vocab=vocab)
    target = wrap_model(target_model)
    prompt = [1, 0, 1, 1, 1, 2, 1, 3, 1, 4, 1, 5, 0, 1]
    with torch.no_grad():
        first = target_model(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
        after = torch.tensor([[*prompt, a] for a in range(vocab)])
        second = target_model(after).logits[:, -1].softmax(-1)  # [V, V]
    exact = (first[:, None] * second).flatten()
    suffix = SuffixDrafter(SuffixOptions(pool=False, min_prob=0.0))
    hybrid = hybrid_drafter(tiny_llama(seed=4, vocab=vocab, layers=1), target)
    hybrid.suffix.pool = None
    hybrid.prior_cost = 0.01  # the model's chain pays: both parts draft
    for drafter in (suffix, hybrid):
        engine = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed")
        counts = torch.zeros(vocab * vocab)
        drafted = 0
        for seed in range(3000):
            result = engine.generate(prompt, max_new_tokens=3, temperature=1.0, seed=seed)
            counts[result.token_ids[0] * vocab + result.token_ids[1]] += 1
            drafted += result.stats.drafted > 0
        assert drafted > 2500  # the first step drafted, nearly always
        assert chi_square(counts, exact) < chi_square_limit(vocab * vocab)
    assert hybrid.chosen["model"] > 0


def test_spec_strings_and_refusals():
    assert str(DraftSpec.parse("suffix")) == "suffix"
    spec = DraftSpec.parse("suffix:depth=8,pool=off,min-prob=0.2")
    assert spec.kind == "suffix" and spec.suffix == SuffixOptions(depth=8, pool=False, min_prob=0.2)
    assert DraftSpec.parse(str(spec)) == spec
    hybrid = DraftSpec.parse("some/model:int4+suffix:nodes=8")
    assert hybrid.kind == "hybrid" and str(hybrid.model) == "some/model:int4"
    assert hybrid.suffix.nodes == 8 and DraftSpec.parse(str(hybrid)) == hybrid
    assert resolve_draft("suffix:pool=off", None).pool is None
    for bad, why in [
        ("suffix:", "suffix or suffix:KEY=VALUE"),
        ("suffix:depth=0", "depth and nodes need >= 1"),
        ("suffix:deep=3", "bad suffix option 'deep=3'"),
        ("suffix:pool=maybe", "pool"),
        ("suffix:factor=nan", "factor"),
        ("ngram+suffix", "a hybrid drafts with a model"),
        ("+suffix", "MODEL\\+suffix"),
    ]:
        with pytest.raises(ValueError, match=why):
            DraftSpec.parse(bad)
    target = wrap_model(tiny_llama(seed=0))
    with pytest.raises(ValueError, match="drafts trees of its own shape"):
        SpeculativeDecoder(target, SuffixDrafter(), tree="dynamic:8")
    with pytest.raises(ValueError, match="confidence needs a model draft"):
        SpeculativeDecoder(target, _hybrid(target), confidence=0.5)


def test_suffix_drafts_export_to_vllms_suffix_method():
    from specdecode.config import RunConfig, to_vllm_speculative_config

    exported = to_vllm_speculative_config(RunConfig(target="t", draft="suffix:depth=8,pool=off"))
    assert exported["method"] == "suffix" and exported["num_speculative_tokens"] == 8
    assert exported["suffix_decoding_max_cached_requests"] == 0
    assert "suffix_decoding_max_cached_requests" not in to_vllm_speculative_config(
        RunConfig(target="t", draft="suffix")
    )
    with pytest.raises(ValueError, match="one speculative method per engine"):
        to_vllm_speculative_config(RunConfig(target="t", draft="some/model+suffix"))


def test_the_default_policy_is_the_measured_one():
    target = wrap_model(tiny_llama(seed=0))
    engine = SpeculativeDecoder(target, SuffixDrafter())
    assert isinstance(engine.k_policy, CostK)
    assert isinstance(
        SpeculativeDecoder(target, SuffixDrafter(), k_policy="fixed").k_policy, FixedK
    )
    assert isinstance(HybridDrafter, type)
