"""The static key/value stores (store.py's StaticStore, lean.py's LeanStore): rows as caches,
rollback / compact / copy, one forward over ragged rows, StoreFull, refusals."""

from __future__ import annotations

import pytest
import torch

from specdecode.core.batch import Batch, fork_drafter
from specdecode.core.cache import KVCache, forward_rows
from specdecode.core.decode import decode
from specdecode.core.policies import FixedK
from specdecode.core.store import StaticStore, StoreFull
from specdecode.core.tree import TokenTree, verification_inputs
from specdecode.core.types import Stats
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.tree_model import TreeModelDrafter
from specdecode.drafters.tree_shape import parse_tree_spec
from specdecode.models.lean import LeanCache, LeanStore, target_cache

from conftest import (
    ARCHS,
    VOCAB,
    WIDE,
    _llama_like,
    needs_kernel,
    noisy_copy,
    on_kernel,
    tiny_llama,
)

ATOL = 1e-5  # float32: a batched forward rounds a little differently from one row's


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _fresh(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's own forward over a sequence from scratch: logits [n, V]."""
    with torch.inference_mode():
        return KVCache(model).forward(ids)


# -- a row is a cache -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_store_row_forwards_like_the_models_own_cache(arch):
    model = ARCHS[arch](seed=0)
    store = StaticStore(model, rows=2, max_len=32)
    row = store.open_row()
    seq = _ids(12, 0)
    with torch.inference_mode():
        head = row.forward(seq[:9])
        tail = row.forward(seq[9:])  # a second forward over the cached prefix
        last = row.forward(seq[:1], last_only=True)
    want = _fresh(model, torch.cat([seq, seq[:1]]))
    torch.testing.assert_close(torch.cat([head, tail, last]), want, atol=ATOL, rtol=0)
    assert len(row) == 13 and last.shape == (1, VOCAB)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_rollback_compact_and_copy_equal_a_fresh_prefill(arch):
    model = ARCHS[arch](seed=1)
    store = StaticStore(model, rows=3, max_len=32)
    row = store.open_row()
    seq = _ids(10, 1)
    new = _ids(3, 2)
    with torch.inference_mode():
        # rollback: forget positions 6.. and decode on from there
        row.forward(seq)
        row.rollback(6)
        got = row.forward(new)
        torch.testing.assert_close(
            got, _fresh(model, torch.cat([seq[:6], new]))[6:], atol=ATOL, rtol=0
        )
        # copy: two independent rows over the same positions
        twin = row.copy()
        assert twin.row != row.row and len(twin) == len(row) == 9
        a, b = row.forward(seq[:2]), twin.forward(new[:1])
        prefix = torch.cat([seq[:6], new])
        torch.testing.assert_close(
            a, _fresh(model, torch.cat([prefix, seq[:2]]))[9:], atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            b, _fresh(model, torch.cat([prefix, new[:1]]))[9:], atol=ATOL, rtol=0
        )
        # compact: a token tree's accepted path moved down next to the root
        tree = TokenTree(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, -1, 0, 2]))
        cache = twin
        cache.rollback(5)
        root = int(prefix[5])
        ids, positions, mask = verification_inputs(tree, root, len(cache), torch.float32)
        cache.forward(ids, position_ids=positions, attention_mask=mask)
        path = [0, 2, 3]  # 7 -> 9 -> 10
        cache.compact(torch.cat([torch.arange(6), torch.tensor(path) + 6]))
        assert len(cache) == 9
        got = cache.forward(torch.tensor([11]))
        accepted = torch.cat([prefix[:6], torch.tensor([7, 9, 10, 11])])
        torch.testing.assert_close(got, _fresh(model, accepted)[-1:], atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="cannot roll back a cache of 10 positions to 11"):
        cache.rollback(11)
    with pytest.raises(ValueError, match="increasing positions"):
        cache.compact([0, 10])


# -- one forward over ragged rows -----------------------------------------------------------------


def _rows_and_caches(model, store, lengths, seed=0):
    """Store rows and KVCaches prefilled over the same random prefixes of `lengths`."""
    rows, caches = [], []
    with torch.inference_mode():
        for i, n in enumerate(lengths):
            prefix = _ids(n, seed + i)
            for cache, out in ((store.open_row(), rows), (KVCache(model), caches)):
                if n:
                    cache.forward(prefix)
                out.append(cache)
    return rows, caches


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_forward_rows_over_ragged_rows_equals_each_rows_own_forward(arch):
    model = ARCHS[arch](seed=2)
    store = StaticStore(model, rows=4, max_len=32)
    rows, caches = _rows_and_caches(model, store, [3, 9, 0, 5])
    inputs = [_ids(1, 10), _ids(4, 11), _ids(2, 12), _ids(3, 13)]
    # the last row verifies a token tree: the root and 2 siblings
    tree = TokenTree(torch.tensor([4, 5]), torch.tensor([-1, -1]))
    tree_ids, tree_pos, tree_mask = verification_inputs(tree, 6, 5, torch.float32)
    inputs[3] = tree_ids
    positions = [None, None, None, tree_pos]
    masks = [None, None, None, tree_mask]
    with torch.inference_mode():
        got = forward_rows(rows, inputs, positions=positions, masks=masks)
        want = forward_rows(caches, inputs, positions=positions, masks=masks)
        assert [len(r) for r in rows] == [len(c) for c in caches] == [4, 13, 2, 8]
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        # and once more, last position only, over what the first forward cached
        got = forward_rows(rows[:3], inputs[:3], last_only=True)
        want = forward_rows(caches[:3], inputs[:3], last_only=True)
    for g, w in zip(got, want, strict=True):
        assert g.shape == (1, VOCAB)
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


@pytest.mark.parametrize("order", [[0, 2], [2, 0], [3, 1, 0]])
def test_rows_that_are_not_contiguous_in_the_store(order):
    model = tiny_llama(seed=3)
    store = StaticStore(model, rows=4, max_len=32)
    rows, caches = _rows_and_caches(model, store, [4, 7, 2, 6])
    assert [r.row for r in rows] == [0, 1, 2, 3]
    inputs = [_ids(i + 1, 20 + i) for i in range(len(order))]
    with torch.inference_mode():
        got = forward_rows([rows[i] for i in order], inputs)
        want = forward_rows([caches[i] for i in order], inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    untouched = [i for i in range(4) if i not in order]
    assert all(len(rows[i]) == len(caches[i]) for i in range(4))
    assert all(len(rows[i]) == [4, 7, 2, 6][i] for i in untouched)


def test_a_row_near_max_len_fits_next_to_a_row_with_more_inputs():
    """Padding a short row to the batch's longest input needs no room the row itself does not
    need, and what the padding wrote is never read: a store sized for each row alone serves
    them together."""
    model = tiny_llama(seed=4)
    store = StaticStore(model, rows=2, max_len=10)
    rows, caches = _rows_and_caches(model, store, [9, 2])
    with torch.inference_mode():
        # row 0 reaches max_len exactly, padded to row 1's 5 inputs
        inputs = [_ids(1, 30), _ids(5, 31)]
        for g, w in zip(forward_rows(rows, inputs), forward_rows(caches, inputs), strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        assert [len(r) for r in rows] == [10, 7]
        # row 0, rolled back, is padded past its length; its next forward sees none of it
        for cache in (rows[0], caches[0]):
            cache.rollback(5)
        inputs = [_ids(1, 32), _ids(3, 33)]
        for g, w in zip(forward_rows(rows, inputs), forward_rows(caches, inputs), strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        got, want = rows[0].forward(_ids(4, 34)), caches[0].forward(_ids(4, 34))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert [len(r) for r in rows] == [10, 10]


def test_a_batch_decodes_in_a_store_sized_for_each_row_alone():
    target = tiny_llama(seed=5)
    draft = noisy_copy(target, 0.05)
    # the first row's first step drafts 3 (its room) next to the second's 4, and fills its row
    prompts, news = [list(range(1, 13)), [7, 8]], [4, 14]
    # each row's cache holds at most prompt + max_new_tokens - 1 positions (15 for both)
    max_len = max(len(p) + n - 1 for p, n in zip(prompts, news, strict=True))
    store = StaticStore(target, rows=2, max_len=max_len)
    batch = Batch(target, policy=FixedK(4), new_cache=lambda m: store.open_row())
    rows = [
        batch.add(p, n, drafter=ModelDrafter(draft)) for p, n in zip(prompts, news, strict=True)
    ]
    while batch.running():
        batch.step()
    for row, prompt, n in zip(rows, prompts, news, strict=True):
        own = StaticStore(target, rows=1, max_len=max_len)  # enough for the row alone
        alone = decode(
            target,
            prompt,
            n,
            drafter=ModelDrafter(draft),
            k=4,
            new_cache=lambda m, s=own: s.open_row(),
        )
        assert row.state.tokens[len(prompt) :] == [t for chunk in alone for t in chunk]


# -- StoreFull and the row pool -------------------------------------------------------------------


def test_store_full_when_every_row_is_taken_and_a_closed_rows_slot_is_reused():
    model = tiny_llama(seed=0)
    store = StaticStore(model, rows=3, max_len=16)
    rows = [store.open_row() for _ in range(3)]
    assert store.free_rows == 0
    with pytest.raises(StoreFull, match="all 3 rows of the key/value store are in use"):
        store.open_row()
    with pytest.raises(StoreFull, match="all 3 rows"):
        rows[0].copy()
    rows[1].close()
    rows[1].close()  # closing twice is a no-op
    assert store.free_rows == 1
    reused = store.open_row()
    assert reused.row == 1 and len(reused) == 0  # an empty row, whatever the old one held
    with pytest.raises(ValueError, match="open rows of one store"):
        forward_rows([rows[0], rows[1]], [_ids(1, 0), _ids(1, 1)])
    other = StaticStore(model, rows=1, max_len=16).open_row()
    with pytest.raises(ValueError, match="open rows of one store"):
        forward_rows([rows[0], other], [_ids(1, 0), _ids(1, 1)])
    with pytest.raises(ValueError, match="row 2 is not taken"):
        StaticStore(model, rows=3, max_len=16).give_back(2)


def test_store_full_past_max_len_leaves_the_row_as_it_was():
    model = tiny_llama(seed=0)
    store = StaticStore(model, rows=2, max_len=8)
    row = store.open_row()
    with torch.inference_mode():
        row.forward(_ids(6, 0))
        with pytest.raises(
            StoreFull, match="a sequence of 9 positions does not fit the store's max_len of 8"
        ):
            row.forward(_ids(3, 1))
        assert len(row) == 6
        row.forward(_ids(2, 1))  # what fits still goes in
    assert len(row) == 8
    batch = Batch(model, new_cache=lambda m: store.open_row())
    with pytest.raises(StoreFull, match="max_len of 8"):
        batch.add(list(range(12)), 4)  # its prompt alone does not fit


def test_store_sizes_are_checked():
    model = tiny_llama(seed=0)
    with pytest.raises(ValueError, match="at least one row"):
        StaticStore(model, rows=0, max_len=8)
    with pytest.raises(ValueError, match="max_len must be an integer >= 2"):
        StaticStore(model, rows=1, max_len=1)
    store = StaticStore(model, rows=2, max_len=8)
    # keys and values of 2 layers: [rows 2, Hkv 2, max_len + 1 (the scratch position), d 8]
    assert store.nbytes == 2 * 2 * (2 * 2 * 9 * 8) * 4


def test_attention_that_ignores_a_custom_mask_is_refused():
    flash = tiny_llama(seed=0)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"key/value store.*attn_implementation='sdpa'"):
        StaticStore(flash, rows=2, max_len=8)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    windowed = _llama_like(
        Qwen2Config, Qwen2ForCausalLM, 0, VOCAB, 2, use_sliding_window=True, sliding_window=4
    )
    with pytest.raises(ValueError, match=r"key/value store.*sliding-window"):
        StaticStore(windowed, rows=2, max_len=8)
    eager = tiny_llama(seed=0)
    eager.set_attn_implementation("eager")
    StaticStore(eager, rows=1, max_len=8)  # eager adds the mask as given: accepted


# -- the lean forward's store ---------------------------------------------------------------------


@needs_kernel()
def test_lean_forward_many_is_each_caches_own_forward_bit_for_bit():
    model = on_kernel(tiny_llama(seed=0, layers=3, **WIDE))
    store = LeanStore(model, rows=3, max_len=64)
    with torch.inference_mode():
        rows = []
        for i, n in enumerate([5, 17, 2]):  # one prompt per row, prefilled alone
            row = store.open_row()
            row.forward(_ids(n, i), last_only=True)
            rows.append(row)
        alone = [row.copy() for row in rows]
        assert all(type(c) is LeanCache and not c.fixed for c in alone)
        inputs = [_ids(1, 10), _ids(6, 11), _ids(3, 12)]  # n rows per sequence
        got = forward_rows(rows, inputs)
        want = [cache.forward(ids) for cache, ids in zip(alone, inputs, strict=True)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert [len(r) for r in rows] == [len(c) for c in alone] == [6, 23, 5]


@needs_kernel()
def test_lean_store_full_past_max_len_and_its_rows_are_reused():
    model = on_kernel(tiny_llama(seed=0, layers=2, **WIDE))
    store = LeanStore(model, rows=2, max_len=8)
    row = store.open_row()
    with torch.inference_mode():
        row.forward(_ids(7, 0))
        with pytest.raises(
            StoreFull, match="a sequence of 9 positions does not fit the store's max_len of 8"
        ):
            row.forward(_ids(2, 1))
        assert len(row) == 7
        grown = row.copy()  # a copy is a cache of its own, outside the store: it may grow
        grown.forward(_ids(4, 1))
        assert len(grown) == 11
    second = store.open_row()
    with pytest.raises(StoreFull, match="all 2 rows"):
        store.open_row()
    second.close()
    assert store.open_row() is not None and store.free_rows == 0
    with pytest.raises(ValueError, match="lean forward cannot run this model"):
        LeanStore(ARCHS["gpt2"](seed=0), rows=1, max_len=8)


@needs_kernel()
@pytest.mark.parametrize("tree", [None, "dynamic:6,4,2"])
def test_ragged_bfloat16_rows_on_a_lean_store_are_each_row_alone_bit_for_bit(tree):
    target = on_kernel(tiny_llama(seed=5, layers=3, **WIDE))
    draft = on_kernel(noisy_copy(tiny_llama(seed=5, layers=3, **WIDE), 0.05, seed=6), 4)
    assert isinstance(target_cache(target), LeanCache)
    base = ModelDrafter(draft) if tree is None else TreeModelDrafter(draft, parse_tree_spec(tree))
    # (prompt, max_new_tokens, the step it joins before)
    jobs = [([1, 2, 3], 24, 0), ([7] * 20, 9, 0), ([11], 17, 2), ([4, 9, 4, 9], 3, 1)]
    store = LeanStore(target, rows=4, max_len=64)
    batch = Batch(target, policy=FixedK(4), new_cache=lambda m: store.open_row())
    rows, step = {}, 0
    while len(rows) < len(jobs) or batch.running():
        for i, (prompt, n, join) in enumerate(jobs):
            if join == step and i not in rows:
                rows[i] = batch.add(prompt, n, drafter=fork_drafter(base), stats=Stats())
        batch.step()
        step += 1
    for i, (prompt, n, _) in enumerate(jobs):
        stats = Stats()
        alone = decode(
            target, prompt, n, drafter=fork_drafter(base), k=4, stats=stats, new_cache=target_cache
        )
        assert rows[i].state.tokens[len(prompt) :] == [t for chunk in alone for t in chunk], i
        # the draft's rows are batch invariant too: the same drafts, the same acceptances
        got = rows[i].stats
        assert (got.steps, got.accepted, got.nodes_verified) == (
            stats.steps,
            stats.accepted,
            stats.nodes_verified,
        ), i
    assert sum(r.stats.accepted for r in rows.values()) > 0
