"""benchmarks/policy_load.py: a round keeps its requests in flight and counts every token."""

import itertools

import pytest

from specdecode.core.policies import CostK, FixedK
from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams

from conftest import load_benchmark, noisy_copy, tiny_llama

policy_load = load_benchmark("policy_load")


def test_configurations_are_named_by_their_k():
    target = tiny_llama(0)
    draft = noisy_copy(target, 0.01)
    assert policy_load.engine_for("ar", target, draft).drafter is None
    fixed = policy_load.engine_for("k2", target, draft)
    assert isinstance(fixed.k_policy, FixedK) and fixed.k_policy.k == 2
    cost = policy_load.engine_for("cost3", target, draft)
    assert isinstance(cost.k_policy, CostK) and cost.k_policy.k_max == 3
    with pytest.raises(SystemExit, match="unknown configuration 'kx'"):
        policy_load.engine_for("kx", target, draft)


def test_a_round_keeps_its_rows_in_flight_and_counts_every_committed_token():
    target = tiny_llama(0)
    draft = noisy_copy(target, 0.01)
    session = policy_load.engine_for("cost3", target, draft).batch_session(3, 128)
    prompts = itertools.cycle([[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]])
    request = GenerationRequest(12, SamplingParams(), 0, None, [], False)
    tokens, _, steps, started = policy_load.one_round(session, prompts, request, 7, 3)
    assert sum(g.finished and g.finish_reason in ("length", "stop") for g in started) >= 7
    assert max(size for size, _ in steps) == 3  # three in flight
    assert tokens == sum(len(g.token_ids) for g in started)  # prefill's first tokens included
    assert not session.generations  # the unfinished ones were cancelled
    assert len(started) - 7 <= 2  # a replacement joins only while fewer than 7 have finished
