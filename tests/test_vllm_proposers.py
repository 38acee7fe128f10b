"""Our drafters as vLLM `custom_class` proposers (specdecode.integrations.vllm), called the way
vLLM's model runner calls them: a `VllmConfig`-shaped object, then per step the sampled ids and
the persistent batch's token table (numpy). vLLM itself is never imported here (it is a peer for
benchmarks, lab/benchmarks.md "vLLM"); the real run is in the lab.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specdecode.drafters.ngram import NgramDrafter
from specdecode.integrations.vllm import DRAFT_ENV, NgramProposer, SuffixProposer

MAX_LEN = 64


def vllm_config(k: int) -> SimpleNamespace:
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
    )


class Batch:
    """vLLM's persistent batch as a proposer sees it: a token table and each row's length."""

    def __init__(self, rows: int) -> None:
        self.tokens = np.zeros((rows, MAX_LEN), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int32)

    def put(self, row: int, ids: list[int]) -> None:
        self.tokens[row, : len(ids)] = ids
        self.lengths[row] = len(ids)

    def extend(self, row: int, ids: list[int]) -> None:
        self.put(row, [*self.tokens[row, : self.lengths[row]].tolist(), *ids])

    def propose(self, proposer, sampled: list[list[int]]) -> list[list[int]]:
        return proposer.propose(sampled, self.lengths, self.tokens, slot_mappings=None)


def test_ngram_proposer_drafts_what_our_drafter_drafts(monkeypatch):
    monkeypatch.setenv(DRAFT_ENV, "ngram:1-2")
    proposer = NgramProposer(vllm_config(k=3))
    proposer.load_model(object())  # vLLM hands it the target: nothing to load
    batch = Batch(rows=4)
    rows = [[5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2], [9, 9, 9, 9], [4, 3, 2, 1]]
    for row, ids in enumerate(rows):
        batch.put(row, ids)
    # row 2 is not decoding this step (nothing sampled): no draft for it
    drafts = batch.propose(proposer, [[6], [2], [], [1]])
    expected = [NgramDrafter(1, 2).propose(ids, 3).tokens.tolist() for ids in rows]
    assert drafts == [expected[0], expected[1], [], expected[3]]
    assert drafts[0] == [7, 8, 5] and drafts[1] == [3, 1, 2] and drafts[3] == []
    # a row at the context limit gets none; one near it no more than fits
    batch.put(0, [5, 6] * (MAX_LEN // 2))
    batch.put(1, [1, 2] * 31 + [1])  # 63 tokens: one more fits
    assert batch.propose(proposer, [[6], [1], [], []]) == [[], [2], [], []]


def test_suffix_proposer_follows_its_rows_and_pools_finished_requests(monkeypatch):
    monkeypatch.delenv(DRAFT_ENV, raising=False)
    proposer = SuffixProposer(vllm_config(k=4))
    batch = Batch(rows=2)
    answer = [20, 21, 22, 23, 24, 25, 26, 27]
    # row 0 decodes a request whose answer nothing before it wrote; row 1 one that repeats
    batch.put(0, [1, 2, 3, 4, answer[0]])
    batch.put(1, [7, 8, 9, 10, 11, 7, 8])
    drafts = batch.propose(proposer, [[answer[0]], [8]])
    assert drafts[0] == [] and drafts[1] == [9, 10, 11, 7]  # the prompt's own repeat, k deep
    for token in answer[1:]:  # row 0 goes on one token a step, its row's drafter kept
        batch.extend(0, [token])
        batch.propose(proposer, [[token], []])
    (drafter, ids), _ = proposer.rows[0], None
    assert ids == [1, 2, 3, 4, *answer]
    # a new request takes row 0: the last one is over and its output joins the pool, so a
    # request that starts the same answer is drafted the rest of it
    batch.put(0, [5, 5, 5, answer[0], answer[1]])
    assert batch.propose(proposer, [[answer[1]], []])[0] == answer[2:6]
    assert proposer.rows[0][0] is not drafter
    assert proposer.shared.pool.report()["tokens"] >= len(answer)


def test_suffix_chain_is_a_path_of_its_tree(monkeypatch):
    monkeypatch.setenv(DRAFT_ENV, "suffix:pool=off,depth=3")
    proposer = SuffixProposer(vllm_config(k=8))
    assert proposer.shared.pool is None and proposer.options.depth == 3
    batch = Batch(rows=1)
    # after "1 2" came "3 4 5" twice and "3 6" once: the chain follows the votes, 3 deep
    batch.put(0, [1, 2, 3, 4, 5, 8, 1, 2, 3, 6, 9, 1, 2, 3, 4, 5, 7, 1, 2])
    assert batch.propose(proposer, [[2]]) == [[3, 4, 5]]


def test_a_spec_of_another_kind_is_refused(monkeypatch):
    monkeypatch.setenv(DRAFT_ENV, "suffix")
    with pytest.raises(ValueError, match="is a suffix draft; this proposer drafts ngram"):
        NgramProposer(vllm_config(k=2))
    monkeypatch.setenv(DRAFT_ENV, "ngram:9-1")
    with pytest.raises(ValueError, match="n-gram"):
        NgramProposer(vllm_config(k=2))
