"""Invariant 1 for token trees, sampling: multi-candidate verification is exactly the target's law.

Seeded, so deterministic; thresholds as in test_sampling_lossless.py (mean + 6 sd of the
chi-square), and each test shows its power: a plausible wrong sampler fails it.
"""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import TokenTree
from specdecode.core.types import ForwardMeter
from specdecode.core.verify_tree import multi_candidate_step, verify_tree_sampling
from specdecode.drafters.tree_model import TreeModelDrafter
from specdecode.drafters.tree_shape import parse_tree_spec
from test_sampling_lossless import chi_square, chi_square_limit, exact_step_joint, first_step_draws

from conftest import noisy_copy, tiny_llama

P = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1, 0.0])
Q = torch.tensor([0.1, 0.1, 0.2, 0.3, 0.2, 0.1])


def _draw_candidates(q: torch.Tensor, c: int, gen: torch.Generator, replacement: bool = True):
    """c draws from q as a tree drafter lays them out: one node per distinct token, the
    candidate list in draw order with repeats pointing at the same node."""
    drawn = torch.multinomial(q, c, replacement=replacement, generator=gen).tolist()
    tokens: list[int] = []
    candidates = []
    for token in drawn:
        if token not in tokens:
            tokens.append(token)
        candidates.append(tokens.index(token))
    return tokens, candidates


def _multi_candidate_counts(c: int, replacement: bool, n: int = 12000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(6)
    for _ in range(n):
        tokens, candidates = _draw_candidates(Q, c, gen, replacement)
        q_rows = Q.expand(len(tokens), 6)  # [nodes, V]: every node was drawn from Q
        node, recovered = multi_candidate_step(P, candidates, tokens, q_rows, gen)
        counts[tokens[node] if node is not None else recovered] += 1
    return counts


def test_multi_candidate_iid_draws_are_distributed_as_p():
    limit = chi_square_limit(int((P > 0).sum()))
    assert chi_square(_multi_candidate_counts(c=3, replacement=True), P) < limit
    # power: the same verifier over draws *without* replacement is biased (exactly: 0.4615 on
    # token 0 instead of 0.5) and fails by far
    assert chi_square(_multi_candidate_counts(c=3, replacement=False), P) > 3 * limit


def test_multi_candidate_fixed_candidates_are_distributed_as_p():
    """Deterministic candidates (q one-hot on each), e.g. a greedy tree used for sampling."""
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(6)
    tokens = [3, 0, 5]  # token 5 has p = 0: never emitted
    for _ in range(6000):
        node, recovered = multi_candidate_step(P, [0, 1, 2], tokens, None, gen)
        counts[tokens[node] if node is not None else recovered] += 1
    assert chi_square(counts, P) < chi_square_limit(5)


def test_multi_candidate_edge_cases():
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):  # p == q: the first candidate is always accepted
        assert multi_candidate_step(Q, [0, 1], [2, 3], Q.expand(2, 6), gen) == (0, None)
    zero = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    for _ in range(100):  # p(x) = 0 for every candidate: all rejected, the residual is p
        assert multi_candidate_step(zero, [0, 1], [4, 3], Q.expand(2, 6), gen) == (None, 2)


# -- a whole tree, hand-made distributions --------------------------------------------------------

V = 4
P0 = torch.tensor([0.4, 0.3, 0.2, 0.1])  # the target at the root
P1 = torch.tensor(  # the target after each first token
    [[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.5, 0.0, 0.5]]
)
Q0 = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q1 = torch.tensor(
    [[0.4, 0.3, 0.2, 0.1], [0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7], [0.3, 0.2, 0.3, 0.2]]
)


def _random_tree(gen: torch.Generator, replacement: bool) -> tuple[TokenTree, torch.Tensor]:
    """Root: 2 draws from Q0; each distinct child x: 2 draws from Q1[x]. Returns the tree (laid
    out as the tree drafter does) and the target rows [N+1, V] over it."""
    tokens: list[int] = []
    parents: list[int] = []
    q_rows: list[torch.Tensor] = []
    draws: list[list[int]] = [[]]

    def add(parent: int, q: torch.Tensor) -> list[int]:
        new, seen = [], {}
        for token in torch.multinomial(q, 2, replacement=replacement, generator=gen).tolist():
            if token not in seen:
                seen[token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                q_rows.append(q)
                draws.append([])
                new.append(seen[token])
            draws[parent + 1].append(seen[token])
        return new

    for node in add(-1, Q0):
        add(node, Q1[tokens[node]])
    tree = TokenTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(q_rows), draws)
    rows = [P0]
    for token, depth in zip(tokens, tree.depth.tolist(), strict=True):
        # depth-2 rows only give the bonus token after a leaf, which is not counted
        rows.append(P1[token] if depth == 1 else torch.full((V,), 1.0 / V))
    return tree, torch.stack(rows)  # rows: [N+1, V]


def _first_two_counts(replacement: bool, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V * V)
    for _ in range(n):
        tree, p_target = _random_tree(gen, replacement)
        path, nxt = verify_tree_sampling(tree, p_target, gen)
        emitted = [*tree.tokens[path].tolist(), nxt]
        if len(emitted) == 1:  # the next step would sample the second token from P1[first]
            emitted.append(int(torch.multinomial(P1[emitted[0]], 1, generator=gen)))
        counts[emitted[0] * V + emitted[1]] += 1
    return counts


def test_tree_walk_emits_the_target_joint():
    exact = (P0[:, None] * P1).flatten()  # [V*V]
    limit = chi_square_limit(int((exact > 0).sum()))
    assert chi_square(_first_two_counts(replacement=True, n=12000, seed=3), exact) < limit
    # power: siblings drawn without replacement bias the walk
    assert chi_square(_first_two_counts(replacement=False, n=12000, seed=3), exact) > 2 * limit


# -- the drafter's trees ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*LEAF applies to greedy trees only")
@pytest.mark.parametrize(
    "spec", ["static:3,2", "dynamic:7,3,2", "dynamic:7,3,2,0.3", "dynamic:7,3,2,0,0.9"]
)
def test_sampled_trees_keep_every_draw(spec):  # a LEAF floor is for greedy trees only
    model = tiny_llama(seed=4, vocab=6)
    shape = parse_tree_spec(spec)
    drafter = TreeModelDrafter(model, shape, vocab_size=6)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        drafter.begin([1, 2, 3], SamplingParams(temperature=1.0), gen, ForwardMeter())
        tree = drafter.propose_tree([1, 2, 3], max_depth=3)
        draws = tree.children()
        parents = tree.parents.tolist()
        for node in range(len(tree)):
            assert node in draws[parents[node] + 1]  # every node is one of its parent's draws
        drawn = [len(d) for d in draws if d]
        if shape.dynamic:
            assert len(tree) <= shape.nodes and max(drawn) <= shape.width
        else:
            assert drawn[0] == 3 and all(n == 2 for n in drawn[1:])
        assert tree.q_draft is not None and tree.q_draft.shape == (len(tree), 6)


def test_a_leaf_floor_under_sampling_says_it_applies_to_greedy_trees_only():
    drafter = TreeModelDrafter(tiny_llama(seed=4, vocab=6), parse_tree_spec("dynamic:7,3,2,0,0.9"))
    with pytest.warns(UserWarning, match="LEAF applies to greedy trees only"):
        drafter.begin([1, 2, 3], SamplingParams(temperature=1.0), None, ForwardMeter())


# -- end to end on a tiny model with a small vocabulary -------------------------------------------


@pytest.mark.parametrize(
    ("spec", "params", "n"),
    [
        ("static:3,2", SamplingParams(temperature=1.0), 1200),
        ("dynamic:6,2,2", SamplingParams(temperature=0.7, top_k=4), 700),
        ("dynamic:6,3,2,0.3", SamplingParams(temperature=1.0), 700),
    ],
    ids=["static-t1", "dynamic-t0.7-topk4", "dynamic-floor-t1"],
)
def test_tree_sampling_matches_target_distribution(spec, params, n):
    target = tiny_llama(seed=3, vocab=6)
    draft = noisy_copy(tiny_llama(seed=4, vocab=6), 0.0)  # an unrelated draft
    exact = exact_step_joint(target, params)  # [36]: the first step's two tokens
    engine = SpeculativeDecoder(target, draft, tree=spec, time_forwards=False)
    counts, results = first_step_draws(engine, params, n, [1, 2, 3])
    depth = sum(r.stats.accepted for r in results)
    assert depth > n // 4  # the trees really supply tokens, not only recovered ones
    limit = chi_square_limit(int((exact > 0).sum()))
    assert chi_square(counts, exact) < limit
    # power: n draws from the draft's own joint would fail by far
    draft_joint = exact_step_joint(draft, params)
    on_support = exact > 0
    assert draft_joint[~on_support].sum() > 0.05 or (
        chi_square(draft_joint[on_support] * n, exact[on_support] / exact.sum()) > 5 * limit
    )
