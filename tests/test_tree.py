"""Token trees: masks and positions, one target pass over a tree, compact, greedy identity."""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.batch import Batch
from specdecode.core.cache import KVCache
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import (
    TokenTree,
    ancestor_matrix,
    check_tree_attention,
    verification_inputs,
)
from specdecode.core.types import ForwardMeter, Stats
from specdecode.core.verify_tree import verify_tree_greedy
from specdecode.drafters.early_exit import EarlyExitDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.tree_model import TreeModelDrafter
from specdecode.drafters.tree_shape import TreeShape, parse_tree_spec

from conftest import ARCHS, noisy_copy, tiny_llama, tiny_qwen2

# root -> 0 -> 2 -> 4, root -> 0 -> 3, root -> 1 -> 5
PARENTS = [-1, -1, 0, 0, 2, 1]
TOKENS = [7, 8, 9, 10, 11, 12]


def _tree() -> TokenTree:
    return TokenTree(torch.tensor(TOKENS), torch.tensor(PARENTS))


def _path_tokens(node: int) -> list[int]:
    """The tokens from the root's first child down to `node`."""
    out = []
    while node >= 0:
        out.append(TOKENS[node])
        node = PARENTS[node]
    return out[::-1]


# -- the data structure and its masks ----------------------------------------------------------


def test_depth_ancestors_and_children_of_a_hand_made_tree():
    tree = _tree()
    assert tree.depth.tolist() == [1, 1, 2, 2, 3, 2]
    assert tree.max_depth == 3 and len(tree) == 6
    assert tree.children() == [[0, 1], [2, 3], [5], [4], [], [], []]
    ancestors = {  # row -> ancestor-or-self rows (0 = root, i + 1 = node i)
        0: {0},
        1: {0, 1},
        2: {0, 2},
        3: {0, 1, 3},
        4: {0, 1, 4},
        5: {0, 1, 3, 5},
        6: {0, 2, 6},
    }
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for row, cols in ancestors.items():
        expected[row, sorted(cols)] = True
    assert torch.equal(ancestor_matrix(tree.parents), expected)


def test_verification_inputs_mask_and_positions():
    past = 3
    ids, positions, mask = verification_inputs(
        _tree(), root_token=5, past=past, dtype=torch.float32
    )
    assert ids.tolist() == [5, *TOKENS]
    assert positions.tolist() == [3, 4, 4, 5, 5, 6, 5]  # past + depth, root at depth 0
    assert mask.shape == (1, 1, 7, past + 7)
    allowed = mask[0, 0] == 0
    assert allowed[:, :past].all()  # every row sees the committed prefix
    # the tree block is the ancestor matrix: node 4 (row 5) sees root, 0, 2 and itself
    assert torch.equal(allowed[:, past:], ancestor_matrix(torch.tensor(PARENTS)))
    assert mask[0, 0, 5, past + 2] == torch.finfo(torch.float32).min  # not its cousin node 1


def test_chain_tree_mask_is_causal():
    chain = TokenTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 1]))
    _, positions, mask = verification_inputs(chain, 0, past=2, dtype=torch.float32)
    assert positions.tolist() == [2, 3, 4, 5]
    assert torch.equal(mask[0, 0] == 0, torch.ones(4, 6, dtype=torch.bool).tril(2))


def test_parents_must_come_first():
    with pytest.raises(ValueError, match="parents must come first"):
        TokenTree(torch.tensor([1, 2]), torch.tensor([1, -1]))


# -- one target pass over the tree --------------------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tree_pass_logits_equal_the_sequential_path_logits(arch, attn):
    model = ARCHS[arch](seed=0)
    model.set_attn_implementation(attn)
    prefix = [3, 1, 4, 1, 5]
    cache = KVCache(model)
    with torch.no_grad():
        cache.forward(torch.tensor(prefix[:-1]))
        inputs = verification_inputs(_tree(), prefix[-1], len(cache), torch.float32)
        ids, positions, mask = inputs
        logits = cache.forward(ids, position_ids=positions, attention_mask=mask)  # [7, V]
        sequences = [prefix] + [prefix + _path_tokens(i) for i in range(len(TOKENS))]
        expected = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in sequences])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert len(cache) == len(prefix) - 1 + 7


def test_attention_without_custom_masks_is_refused():
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        check_tree_attention(flash)
    windowed = SimpleNamespace(
        config=SimpleNamespace(_attn_implementation="sdpa", sliding_window=64)
    )
    with pytest.raises(ValueError, match="sliding-window"):
        check_tree_attention(windowed, "draft")
    check_tree_attention(tiny_qwen2())  # full attention, sdpa: accepted


# -- compact --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_compact_equals_a_fresh_prefill_of_the_accepted_sequence(arch):
    model = ARCHS[arch](seed=0)
    prefix = [3, 1, 4, 1, 5]
    cache = KVCache(model)
    with torch.no_grad():
        cache.forward(torch.tensor(prefix[:-1]))
        past = len(cache)
        ids, positions, mask = verification_inputs(_tree(), prefix[-1], past, torch.float32)
        cache.forward(ids, position_ids=positions, attention_mask=mask)
        path = [0, 2, 4]  # accept root -> 0 -> 2 -> 4, then the next token 6
        cache.compact([*range(past + 1), *(past + 1 + i for i in path)])
        accepted = prefix + _path_tokens(4)
        assert len(cache) == len(accepted)
        got = cache.forward(torch.tensor([6]))[-1]
        fresh = model(torch.tensor([[*accepted, 6]])).logits[0, -1]
    torch.testing.assert_close(got, fresh, rtol=1e-4, atol=1e-4)


def test_compact_keeps_a_prefix_and_refuses_bad_positions():
    cache = KVCache(tiny_llama(0))
    with torch.no_grad():
        cache.forward(torch.tensor([1, 2, 3, 4]))
    before = [layer.keys.clone() for layer in cache.hf.layers]
    cache.compact([0, 2])
    for layer, keys in zip(cache.hf.layers, before, strict=True):
        assert torch.equal(layer.keys, keys[..., [0, 2], :])
    for bad in ([1, 0], [0, 0], [0, 5], [-1]):
        with pytest.raises(ValueError, match="increasing"):
            cache.compact(bad)
    cache.compact([])
    assert len(cache) == 0


# -- verification ---------------------------------------------------------------------------------


def test_verify_tree_greedy_hand_made():
    tree = _tree()  # root: 0 (7), 1 (8); 0: 2 (9), 3 (10); 2: 4 (11); 1: 5 (12)
    logits = torch.zeros(7, 16)

    def argmax(row: int, token: int) -> None:
        logits[row] = 0
        logits[row, token] = 1

    for row in range(7):
        argmax(row, 15)  # by default the target disagrees with every child
    assert verify_tree_greedy(tree, logits) == ([], 15)
    argmax(0, 7)  # the target picks node 0, then node 2, then node 4: a leaf -> bonus
    argmax(1, 9)
    argmax(3, 11)
    argmax(5, 13)
    assert verify_tree_greedy(tree, logits) == ([0, 2, 4], 13)
    argmax(3, 14)  # node 4 rejected: the longest accepted path is root -> 0 -> 2
    assert verify_tree_greedy(tree, logits) == ([0, 2], 14)
    argmax(0, 8)  # the other branch: root -> 1 -> 5
    argmax(2, 12)
    assert verify_tree_greedy(tree, logits) == ([1, 5], 15)


# -- shapes ---------------------------------------------------------------------------------------


def test_tree_specs():
    assert parse_tree_spec("static:3,2,2,1,1") == TreeShape(branching=(3, 2, 2, 1, 1))
    assert parse_tree_spec("dynamic:16") == TreeShape(nodes=16)
    assert parse_tree_spec("dynamic:16,5,3") == TreeShape(nodes=16, depth=5, width=3)
    assert str(parse_tree_spec("static:4,1")) == "static:4,1"
    floored = parse_tree_spec("dynamic:5,6,2,0.25")
    assert floored == TreeShape(nodes=5, depth=6, width=2, floor=0.25)
    assert str(floored) == "dynamic:5,6,2,0.25"
    assert str(parse_tree_spec("dynamic:5")) == "dynamic:5,6,4"
    leafy = parse_tree_spec("dynamic:11,8,3,0.2,0.05")
    assert leafy == TreeShape(nodes=11, depth=8, width=3, floor=0.2, leaf=0.05)
    assert str(leafy) == "dynamic:11,8,3,0.2,0.05"
    unfloored = parse_tree_spec("dynamic:11,8,3,0,0.05")  # FLOOR 0 is allowed before a LEAF
    assert unfloored.floor == 0.0 and str(unfloored) == "dynamic:11,8,3,0,0.05"
    for bad, field in (("dynamic:5,6,2,0.2,0", "LEAF"), ("dynamic:5,6,2,0.2,1.5", "LEAF")):
        with pytest.raises(ValueError, match=f"bad tree .*{field} must be"):
            parse_tree_spec(bad)
    for bad in ("dynamic:5,6,2,0", "dynamic:5,6,2,1", "dynamic:5,6,2,x", "static:2,2,2,0.5"):
        with pytest.raises(ValueError, match="bad tree"):
            parse_tree_spec(bad)
    for bad in ("3,2", "static:", "static:3,0", "static:a", "dynamic:0", "dynamic:1,2,3,4"):
        with pytest.raises(ValueError, match="static:3,2,2,1,1"):
            parse_tree_spec(bad)
    with pytest.raises(ValueError, match="at most"):
        parse_tree_spec("static:10,10,10,10")


def test_engine_tree_needs_a_draft_model(llama_pair):
    target, draft = llama_pair
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(target, None, tree="static:2,2")
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(target, NgramDrafter(), tree="static:2,2")
    with pytest.raises(ValueError, match="bad tree"):
        SpeculativeDecoder(target, draft, tree="static:x")


def test_cli_accepts_tree():
    from specdecode.cli import build_parser

    args = build_parser().parse_args(
        ["generate", "--target", "t", "--tree", "static:2,1", "--prompt", "hi"]
    )
    assert args.tree == "static:2,1"


# -- greedy identity end to end -------------------------------------------------------------------

SHAPES = ["static:1,1,1", "static:3,2,2,1,1", "static:4,1", "dynamic:8", "dynamic:16"]
SHAPES += ["dynamic:8,6,2,0.3", "dynamic:8,6,2,0.1,0.05", "dynamic:16,6,4,0,0.2"]
PROMPTS = [[1, 2, 3], [5] * 12, [11]]


@pytest.mark.parametrize("factory", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_tree_greedy_equals_autoregressive(factory):
    target = factory(seed=0)
    ar = SpeculativeDecoder(target)
    references = {tuple(p): ar.generate(p, max_new_tokens=24).token_ids for p in PROMPTS}
    drafts = {
        "close": noisy_copy(target, 0.05, seed=7),
        "unrelated": tiny_llama(seed=99),
        "identical": target,
    }
    for name, draft in drafts.items():
        for spec in SHAPES:
            engine = SpeculativeDecoder(target, draft, tree=spec)
            for prompt in PROMPTS:
                result = engine.generate(prompt, max_new_tokens=24)
                assert result.token_ids == references[tuple(prompt)], (name, spec, prompt)
                stats = result.stats
                assert stats.new_tokens == 24 and stats.nodes_verified > 0
                assert stats.to_dict()["nodes_verified"] == stats.nodes_verified
                if name == "identical" and spec.startswith("static"):
                    assert stats.accepted == stats.drafted  # every step takes the full depth


@pytest.mark.parametrize(
    ("spec", "nodes"), [("dynamic:8,6,2,0.9", 2), ("dynamic:8,6,2,0,0.9", 1)], ids=["FLOOR", "LEAF"]
)
def test_floors_spare_the_forwards_and_rows_of_unlikely_nodes(spec, nodes):
    target = tiny_llama(seed=0)
    draft = tiny_llama(seed=99)  # unrelated: flat-ish distributions, no path near probability 1
    expected = SpeculativeDecoder(target).generate([1, 2, 3], max_new_tokens=16).token_ids
    free = SpeculativeDecoder(target, draft, tree="dynamic:8,6,2").generate([1, 2, 3], 16)
    pruned = SpeculativeDecoder(target, draft, tree=spec).generate([1, 2, 3], 16)
    assert pruned.token_ids == free.token_ids == expected
    # FLOOR: the root is always expanded, its 2 children verified, nothing deeper; LEAF: only the
    # root's most probable child is verified, and no node is worth expanding. One draft forward
    # per tree step either way (the last step, with one token left, drafts nothing)
    stats = pruned.stats
    tree_steps = stats.steps - stats.k_hist.get(0, 0)
    assert stats.draft_forwards == tree_steps and stats.nodes_verified == nodes * tree_steps
    assert free.stats.draft_forwards > 2 * free.stats.steps


def test_leaf_floor_keeps_the_greedy_tree_below_it_unchanged():
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.05, seed=7)
    shape = parse_tree_spec("dynamic:12,5,3")
    leaf = 0.0065  # between this draft's path probabilities (0.005-0.12 here)
    full, leafy = (
        TreeModelDrafter(draft, s, vocab_size=96)
        for s in (shape, dataclasses.replace(shape, leaf=leaf))
    )
    for drafter in (full, leafy):
        drafter.begin([1, 2, 3, 4], SamplingParams(temperature=0.0), None, ForwardMeter())
    a, b = (d.propose_tree([1, 2, 3, 4], max_depth=5) for d in (full, leafy))
    # the leaf tree is the full tree's nodes whose path probability is at least `leaf`, and
    # always node 0 (the root's most probable child, drafted first: no node is more probable)
    probs = [math.exp(full._pool.score[node]) for node in full._kept]
    kept = [i for i in range(len(a)) if i == 0 or probs[i] >= leaf]
    assert b.tokens.tolist() == a.tokens[kept].tolist()
    assert b.parents.tolist() == [kept.index(p) if p >= 0 else -1 for p in a.parents[kept].tolist()]
    assert 1 < len(b) < len(a)


def test_identical_draft_takes_the_full_depth_every_step():
    target = tiny_llama(seed=1)
    expected = SpeculativeDecoder(target).generate([3, 4, 5], max_new_tokens=31).token_ids
    result = SpeculativeDecoder(target, target, tree="static:3,2,2,1,1").generate(
        [3, 4, 5], max_new_tokens=31
    )
    assert result.token_ids == expected
    # the prefill's first token, then 6 tokens per step: depth 5 + the bonus token
    assert result.stats.steps == 5 and result.stats.emitted == 30
    assert result.stats.nodes_verified == 5 * (3 + 6 + 12 + 12 + 12)
    assert result.stats.target_forwards == 5
    assert result.stats.draft_forwards == 5 * 5  # one batched forward per depth


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
def test_tree_stops_exactly(llama_pair, max_new_tokens):
    target, _ = llama_pair
    expected = SpeculativeDecoder(target).generate([1, 2], max_new_tokens).token_ids
    result = SpeculativeDecoder(target, target, tree="static:2,2,2").generate(
        [1, 2], max_new_tokens
    )
    assert result.token_ids == expected and len(expected) == max_new_tokens


def test_early_exit_draft_grows_trees_too():
    target = tiny_llama(seed=0, layers=4)
    expected = SpeculativeDecoder(target).generate([1, 2, 3], max_new_tokens=20).token_ids
    engine = SpeculativeDecoder(target, EarlyExitDrafter(target, 2), tree="static:2,2")
    assert engine.generate([1, 2, 3], max_new_tokens=20).token_ids == expected


def test_eager_attention_end_to_end():
    target, draft = tiny_llama(seed=2), noisy_copy(tiny_llama(seed=2), 0.05)
    expected = SpeculativeDecoder(target).generate([4, 2], max_new_tokens=20).token_ids
    target.set_attn_implementation("eager")
    draft.set_attn_implementation("eager")
    got = SpeculativeDecoder(target, draft, tree="static:3,2,1").generate([4, 2], 20)
    assert got.token_ids == expected


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("spec", ["static:3,2,2", "dynamic:10"])
def test_caches_match_a_fresh_prefill_after_every_tree_step(spec, temperature):
    target = tiny_llama(seed=0)
    draft_model = noisy_copy(target, 0.15)  # far enough to reject somewhere in most steps
    params = SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(0)
    stats = Stats()
    prompt = [3, 1, 4, 1, 5]
    drafter = TreeModelDrafter(draft_model, parse_tree_spec(spec), vocab_size=96)
    batch = Batch(target, meter=stats.meter)
    row = batch.add(prompt, 100, drafter=drafter, params=params, generator=generator, stats=stats)
    state = row.state
    accepted = set()
    for _ in range(8):
        before = stats.accepted
        batch.step()
        accepted.add(stats.accepted - before)
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
    assert len(accepted) > 1, "steps accepted different path lengths"


def test_a_tree_step_reports_its_depth_and_its_nodes():
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.15)
    drafter = TreeModelDrafter(draft, parse_tree_spec("static:3,2,1"), vocab_size=96)
    proposed: list[TokenTree] = []
    propose = drafter.propose_tree

    def noted(context: list[int], max_depth: int) -> TokenTree:
        proposed.append(propose(context, max_depth))
        return proposed[-1]

    drafter.propose_tree = noted
    params, stats, prompt = SamplingParams(), Stats(), [3, 1, 4, 1, 5]
    batch = Batch(target, meter=stats.meter)
    batch.add(prompt, 100, drafter=drafter, params=params, stats=stats)
    steps = []
    for _ in range(3):
        depth, nodes = stats.drafted, stats.nodes_verified
        batch.step()
        steps.append((stats.drafted - depth, stats.nodes_verified - nodes))
    for (depth, nodes), tree in zip(steps, proposed, strict=True):
        assert depth == tree.max_depth == 3  # positions offered along one path
        assert nodes == len(tree) > depth  # every node the target verified
    assert stats.nodes_verified == sum(nodes for _, nodes in steps)


def test_a_protocol_check_is_made_once_per_class():
    from specdecode.core.protocols import Drafter, implements
    from specdecode.core.tree import SizedTreeDrafter, TreeDrafter
    from specdecode.drafters.ngram import NgramDrafter
    from specdecode.drafters.suffix import SuffixDrafter

    for drafter in (NgramDrafter(), SuffixDrafter()):
        for protocol in (Drafter, TreeDrafter, SizedTreeDrafter):
            assert implements(drafter, protocol) == isinstance(drafter, protocol)
            assert implements(drafter, protocol) == isinstance(drafter, protocol)  # cached
    assert implements(SuffixDrafter(), SizedTreeDrafter) and not implements(
        NgramDrafter(), TreeDrafter
    )
