"""A prompt-lookup branch grafted onto a greedy token tree (`+lookup[:N]`)."""

from __future__ import annotations

import copy

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.drafters.tree_model import TreeModelDrafter
from specdecode.drafters.tree_shape import LOOKUP_TOKENS, TreeShape, parse_tree_spec
from specdecode.sampling import SamplingParams
from specdecode.step import prefill
from specdecode.tree_decode import tree_step
from specdecode.types import ForwardMeter, Stats

from conftest import noisy_copy, tiny_llama, tiny_qwen2

# a prompt that repeats itself: its last 5 tokens (6, 5, 1, 2, 3) occurred at its start, followed
# by 11, 12, 1, 2, 3; its last 3 (1, 2, 3) more recently, followed by 9, 8, 7, ...
REPEATING = [4, 9, 8, 7, 6, 5, 1, 2, 3, 11, 12, 1, 2, 3, 9, 8, 7, 6, 5, 1, 2, 3]
CONTINUATION = (11, 12, 1, 2, 3)  # the longest match wins
PROMPTS = [REPEATING, [5] * 12, [1, 2, 3], [11]]


def test_lookup_specs():
    shape = parse_tree_spec("dynamic:5,6,2,0.3+lookup")
    assert shape == TreeShape(nodes=5, depth=6, width=2, floor=0.3, lookup=LOOKUP_TOKENS)
    assert str(shape) == f"dynamic:5,6,2,0.3+lookup:{LOOKUP_TOKENS}"
    assert parse_tree_spec(str(shape)) == shape  # the name round-trips
    static = parse_tree_spec("static:3,2+lookup:12")
    assert (
        static == TreeShape(branching=(3, 2), lookup=12) and str(static) == "static:3,2+lookup:12"
    )
    assert parse_tree_spec("dynamic:11,8,3,0.2,0.05+lookup:4").lookup == 4
    assert parse_tree_spec("dynamic:8").lookup == 0
    bad_lookups = ("dynamic:8+lookup:0", "dynamic:8+lookup:65", "dynamic:8+lookup:x")
    bad_lookups += ("dynamic:8+", "dynamic:8+lookups", "dynamic:8+ngram:3", "static:2+lookup:-1")
    for bad in bad_lookups:
        with pytest.raises(ValueError, match="bad tree"):
            parse_tree_spec(bad)
    with pytest.raises(ValueError, match="bad tree"):
        parse_tree_spec("dynamic:x+lookup")  # the shape before the + is checked as before


def _drafted(spec: str, draft, context: list[int]) -> TreeModelDrafter:
    drafter = TreeModelDrafter(draft, parse_tree_spec(spec), vocab_size=96)
    drafter.begin(context, SamplingParams(temperature=0.0), None, ForwardMeter())
    return drafter


def _node_paths(tree) -> list[tuple[int, ...]]:
    """Each node's root-to-node token path, in node order."""
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    paths: list[tuple[int, ...]] = []
    for parent, token in zip(parents, tokens, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


def _paths(tree) -> set[tuple[int, ...]]:
    return set(_node_paths(tree))


@pytest.mark.parametrize("spec", ["dynamic:6,4,2", "static:2,2,1"])
def test_the_lookup_branch_is_grafted_onto_the_tree_the_draft_grows(spec):
    draft = tiny_llama(seed=99)
    plain = _drafted(spec, draft, REPEATING)
    grafted = _drafted(f"{spec}+lookup:5", draft, REPEATING)
    a = plain.propose_tree(REPEATING, max_depth=8)
    b = grafted.propose_tree(REPEATING, max_depth=8)
    branch = {CONTINUATION[:i] for i in range(1, 6)}
    # the drafted tree is unchanged, the lookup chain is one more path, and nothing else is new
    assert _paths(b) == _paths(a) | branch
    assert len(b) == len(a) + len(branch - _paths(a))
    # the new nodes were never fed to the draft: its cache holds the context and drafted nodes
    assert len(grafted.cache) == len(plain.cache)
    new = [i for i, path in enumerate(_node_paths(b)) if path not in _paths(a)]
    assert new and all(grafted._pool.slot[grafted._kept[i]] == -1 for i in new)
    # no match (no earlier occurrence of the last 3-gram): the tree the draft grew, alone
    lonely = [1, 2, 3, 4, 5, 6]
    c = _drafted(f"{spec}+lookup:5", draft, lonely).propose_tree(lonely, max_depth=8)
    d = _drafted(spec, draft, lonely).propose_tree(lonely, max_depth=8)
    assert _paths(c) == _paths(d)


def test_the_lookup_branch_stops_at_the_steps_depth_limit():
    grafted = _drafted("static:1+lookup:8", tiny_llama(seed=99), REPEATING)
    tree = grafted.propose_tree(REPEATING, max_depth=3)
    assert tree.max_depth <= 3 and CONTINUATION[:3] in _paths(tree)


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_greedy_output_with_a_lookup_branch_is_the_targets(factory):
    target = factory(seed=0)
    ar = SpeculativeDecoder(target)
    drafts = {"close": noisy_copy(target, 0.05, seed=7), "unrelated": tiny_llama(seed=99)}
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=24).token_ids
        for name, draft in drafts.items():
            for spec in ("dynamic:8,6,2,0.1,0.05+lookup", "static:2,2,1+lookup:3"):
                result = SpeculativeDecoder(target, draft, tree=spec).generate(prompt, 24)
                assert result.token_ids == expected, (name, spec, prompt)
                assert result.stats.new_tokens == 24


def test_lookup_accepts_what_an_unrelated_draft_cannot():
    # a tiny random target falls into a loop; prompt lookup then predicts it, the draft does not
    target = tiny_llama(seed=0)
    draft = tiny_llama(seed=99)
    prompt = [1, 2, 3]
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=64).token_ids
    plain = SpeculativeDecoder(target, draft, tree="static:2,1").generate(prompt, 64)
    grafted = SpeculativeDecoder(target, draft, tree="static:2,1+lookup:8").generate(prompt, 64)
    assert plain.token_ids == grafted.token_ids == expected
    assert grafted.stats.accepted > 2 * plain.stats.accepted
    assert grafted.stats.steps < plain.stats.steps


def test_caches_match_a_fresh_prefill_after_every_step_with_a_lookup_branch():
    target = tiny_llama(seed=0)
    draft_model = noisy_copy(target, 0.15)
    params = SamplingParams(temperature=0.0)
    stats = Stats()
    state, _ = prefill(target, REPEATING, params, None, stats)
    drafter = TreeModelDrafter(draft_model, parse_tree_spec("dynamic:6,4,2+lookup:6"), 96)
    drafter.begin(state.tokens, params, None, stats.meter)
    for _ in range(10):
        tree_step(state, drafter, params, None, stats)
        tokens = state.tokens
        assert len(state.target_cache) == len(tokens) - 1  # invariant 2
        for model, cache in ((target, state.target_cache), (draft_model, drafter.cache)):
            cached = len(cache)
            assert cached <= len(tokens) - 1
            probe = copy.deepcopy(cache)
            with torch.no_grad():
                got = probe.forward(torch.tensor([tokens[cached]]))[-1]
                fresh = model(torch.tensor([tokens[: cached + 1]])).logits[0, -1]
            torch.testing.assert_close(got, fresh, rtol=1e-4, atol=1e-4)


def test_sampled_trees_draft_without_the_lookup_branch():
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.05, seed=7)
    outputs = []
    for spec in ("dynamic:8,4,2", "dynamic:8,4,2+lookup"):
        engine = SpeculativeDecoder(target, draft, tree=spec)
        if "lookup" in spec:
            with pytest.warns(UserWarning, match="greedy trees only"):
                outputs.append(engine.generate(REPEATING, 20, temperature=1.0, seed=3).token_ids)
        else:
            outputs.append(engine.generate(REPEATING, 20, temperature=1.0, seed=3).token_ids)
    assert outputs[0] == outputs[1]
